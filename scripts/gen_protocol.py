"""Regenerate ``service/core/protocol/*_pb2.py`` (and ``.pyi``): the Open Inference Protocol's gRPC messages.

The messages are Triton's ``grpc_service.proto`` and ``model_config.proto`` (a superset of KServe's
``grpc_predict_v2.proto``, same package ``inference``). We take their descriptors from the installed tritonclient
rather than from a copy of the ``.proto`` files, so that our generated modules are byte-for-byte the same files
tritonclient registers: both can be imported in one process (protobuf refuses two different files defining the
same ``inference.*`` names) and what we serve is exactly what the client speaks.

    .venv/bin/python scripts/gen_protocol.py

Needs the dev extras (tritonclient[grpc], grpcio-tools). Only message code is generated (protobuf, no grpc), so
``service/core`` and the load tester can import it; the gRPC service glue lives in ``service/frontend/grpc``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "service" / "core" / "protocol"
PACKAGE = "service.core.protocol"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help=f"folder to write into (default: {OUT})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc  # type: ignore[import-untyped]
    from tritonclient.grpc import model_config_pb2, service_pb2

    files = descriptor_pb2.FileDescriptorSet()
    for module in (model_config_pb2, service_pb2):
        files.file.add().ParseFromString(module.DESCRIPTOR.serialized_pb)
    with tempfile.TemporaryDirectory() as tmp:
        descriptors = Path(tmp) / "inference.pb"
        descriptors.write_bytes(files.SerializeToString())
        flags = [f"--descriptor_set_in={descriptors}", f"--python_out={args.out}", f"--pyi_out={args.out}"]
        code = protoc.main(["protoc", *flags, "model_config.proto", "grpc_service.proto"])
    if code != 0:
        print(f"protoc failed with {code}", file=sys.stderr)
        return 1
    # protoc writes "import model_config_pb2"; inside a package the import must be absolute.
    for name in ("grpc_service_pb2.py", "grpc_service_pb2.pyi"):
        path = args.out / name
        text = re.sub(r"^import model_config_pb2 as", f"from {PACKAGE} import model_config_pb2 as", path.read_text(),
                      flags=re.M)  # fmt: skip
        path.write_text(text)
    print(f"wrote {', '.join(sorted(p.name for p in args.out.glob('*_pb2.py*')))} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
