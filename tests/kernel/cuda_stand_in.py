"""Stand-in ``libcuda.so.1`` libraries, compiled with ``cc`` for the CUDA-detection tests.

Why: no machine here has the CUDA driver, yet the detector must be shown to (a) notice a mapped
``libcuda`` and (b) read the driver's answer to ``cuDeviceGetCount`` correctly. A stand-in
without symbols plays "a library that cannot say"; one whose ``cuDeviceGetCount`` returns a
chosen ``CUresult`` plays a driver before ``cuInit`` (3), after it (0) or after a failed one
(100, no device). Each is loaded only in child processes (kernels, ``python -c``): a library
mapped into the pytest process would stay there and change every later answer.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SONAME = "libcuda.so.1"

_WITH_COUNT = """
int cuDeviceGetCount(int *count) {
    *count = 0;
    return STAND_IN_RESULT;
}
"""
_EMPTY = "int stand_in_libcuda_marker = 1;\n"


def build_stand_in(directory: Path, *, result: int | None = None) -> Path:
    """Compile a stand-in ``libcuda.so.1`` into ``directory`` and return its path.

    ``result``: what its ``cuDeviceGetCount`` returns; ``None`` leaves that symbol out.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("a C compiler (cc) is needed to build the stand-in libcuda")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "stand_in_libcuda.c"
    source.write_text(_EMPTY if result is None else _WITH_COUNT)
    library = directory / SONAME
    defines = [] if result is None else [f"-DSTAND_IN_RESULT={result}"]
    subprocess.run(
        [compiler, "-shared", "-fPIC", f"-Wl,-soname,{SONAME}", *defines, "-o", str(library),
         str(source)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return library
