"""Regenerate the committed Python stubs from the .proto files.

    python -m protos.generate          # rewrite protos/specpool/v1/*_pb2*.py
    python -m protos.generate --check  # exit 1 if the committed stubs are stale

The stubs are committed (so an installed package imports them with no build step) and
tests/test_protos.py fails when they no longer match the .proto sources.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path(__file__).resolve().parent / "specpool" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpc_tools) on every .proto; returns the generated files under out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    sources = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "protos" / "specpool" / "v1").glob("*_pb2*"))


def stale_files() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh
                 if not (PROTO_DIR / f.name).exists() or (PROTO_DIR / f.name).read_text() != f.read_text()]
    return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        print("stale: " + ", ".join(stale) if stale else "stubs up to date")
        sys.exit(1 if stale else 0)
    generate(ROOT)
    print(f"regenerated stubs in {PROTO_DIR}")


if __name__ == "__main__":
    main()
