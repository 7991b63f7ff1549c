"""Generate the Python code (messages, gRPC stubs, type stubs) of every proto under protos/.

    python scripts/gen_protos.py           # write protos/pdmesh_proto/**/*_pb2*.py(i) beside
                                           # the .proto files
    python scripts/gen_protos.py --check   # exit 1 if the committed code is stale

The generated package `pdmesh_proto` is its own distribution (protos/, light: grpcio and protobuf);
the client SDK and every service depend on it, so a process holds one copy of each message.
Generated files are never edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = PROTO_ROOT
OUT_PACKAGE = "pdmesh_proto"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package = out_dir / OUT_PACKAGE
    for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").write_text(
            '"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n'
        )
    return sorted(p.relative_to(out_dir) for p in package.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed files instead"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        committed = sorted(
            p.relative_to(OUT_ROOT)
            for p in (OUT_ROOT / OUT_PACKAGE).rglob("*")
            if p.is_file() and p.suffix not in (".proto", ".typed") and "__pycache__" not in p.parts
        )
        if args.check:
            stale = [
                str(f)
                for f in files
                if not (OUT_ROOT / f).exists()
                or not filecmp.cmp(Path(tmp) / f, OUT_ROOT / f, False)
            ]
            stale += [str(f) for f in committed if f not in files]
            if stale:
                print(
                    "stale generated code (run scripts/gen_protos.py):",
                    *stale,
                    sep="\n  ",
                    file=sys.stderr,
                )
                return 1
            return 0
        for stale in committed:
            (OUT_ROOT / stale).unlink()
        for f in files:
            (OUT_ROOT / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / f, OUT_ROOT / f)
    print(f"wrote {len(files)} files under protos/{OUT_PACKAGE}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
