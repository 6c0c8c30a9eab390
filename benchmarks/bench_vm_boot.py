"""The VM tier's fixed costs: a cold image build and a boot to a usable guest.

Run as root with the VM tier's host tools (``bash .ci/setup --with-vm``):

    .venv/bin/python benchmarks/bench_vm_boot.py [--cold] [--boots 2]

``--cold`` builds the image into a fresh cache directory (the cached one is left alone) and
times ``mmdebstrap`` + ``mkfs``; otherwise the cached image is used (built first if missing).
Each boot is timed from qemu's start to the first ssh command that succeeds, and to "ready"
(the test venv mounted and the source tree installed). The host's load average is printed
beside each figure: under emulation the timings follow it. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vm.image import ensure_image
from tests.vm.machine import boot

ROOT = Path(__file__).resolve().parents[1]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="build into a fresh cache")
    parser.add_argument("--boots", type=int, default=2)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="bench-vm-")) if args.cold else None
    try:
        started = time.monotonic()
        image = ensure_image(cache)
        print(f"image {image.key}: ready in {time.monotonic() - started:.0f} s (load {_load()})")
        print(f"  rootfs allocated {image.rootfs.stat().st_blocks * 512 / 2**20:.0f} MiB")
        for number in range(args.boots):
            run_dir = Path(tempfile.mkdtemp(prefix="bench-vm-run-"))
            try:
                with boot(image, run_dir, tree=ROOT) as vm:
                    print(
                        f"boot {number + 1} ({'kvm' if vm.kvm else 'tcg'}): ssh after "
                        f"{vm.boot_seconds:.0f} s, ready after {vm.timings['ready']:.0f} s "
                        f"(load {_load()})"
                    )
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
