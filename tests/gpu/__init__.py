"""The real-GPU tier (tier 5): hot-plug a real NVIDIA GPU into a running sandbox.

Runs on a GPU machine through ``bash tests/gpu/run-on-device.sh`` (nothing fetched there), and
here as a rehearsal on the simulated NVML (``run-on-device.sh --simulate``, no network). See
``docs/testing.md``, "Tier 5".
"""
