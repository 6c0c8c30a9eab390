"""NVML: everything the product knows about reading NVIDIA GPUs, and the simulator behind it.

Both the node agent (inventory: UUID → minor, busy processes) and the notebook side (live
metrics) read GPUs through this package and nothing else, so there is one place that talks to
``pynvml``. ``nvml.sim`` provides a fake ``libnvidia-ml.so.1`` that the same, unmodified
``pynvml`` loads, so simulation mode and the tests exercise the real code path without a GPU.
``checkpoint`` binds the CUDA driver's process checkpoint calls (suspend a process's GPU state
to host memory and back), which the simulator's ``libcuda.so.1`` implements too.
"""
