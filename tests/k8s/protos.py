"""The tier's protobuf messages, compiled from ``protos/*.proto`` when first needed.

Why at test time: generated ``_pb2`` modules pin the protobuf runtime they were generated for,
so committed ones would break with the next protobuf release; ``grpcio-tools`` (a test extra)
regenerates them in well under a second, into a private temporary directory, once per process.
Only message classes are generated: the simulator calls and serves methods by their explicit
upstream paths (see the ``.proto`` headers for why).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Final

PROTO_DIR: Final = Path(__file__).parent / "protos"


@functools.cache
def _generate_all() -> dict[str, ModuleType]:
    from grpc_tools import protoc

    sources = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    modules = {}
    with tempfile.TemporaryDirectory(prefix="k8stier-pb2-") as out:
        if protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", *sources]) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
        for source in sources:
            name = source.removesuffix(".proto")
            module_name = f"tests.k8s._generated.{name}_pb2"
            spec = importlib.util.spec_from_file_location(module_name, Path(out, f"{name}_pb2.py"))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            modules[name] = module
    return modules


def load(name: str) -> ModuleType:
    """The generated module of ``protos/<name>.proto`` (e.g. ``"k8stier_cri"``)."""
    return _generate_all()[name]
