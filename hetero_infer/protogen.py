"""Regenerate the Python stubs in `hetero/v1/` from `protos/` (one command, reproducible).

    python -m hetero_infer.protogen            # write hetero/v1/*_pb2*.py
    python -m hetero_infer.protogen --check    # exit 1 when the committed stubs are stale

Uses grpcio-tools' bundled protoc, so the output depends only on the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("hetero") / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir`; return the generated files relative to it."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    package = out_dir / PROTO_PACKAGE_DIR
    for init in (out_dir / "hetero" / "__init__.py", package / "__init__.py"):
        init.touch()
    return sorted(p.relative_to(out_dir) for p in package.iterdir() if p.suffix in (".py", ".pyi"))


def stale_files() -> list[str]:
    """Generated files that differ from (or are missing in) the committed tree."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = {p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_PACKAGE_DIR).glob("*_pb2*.py*")}
        stale = [str(rel) for rel in fresh if not (REPO_ROOT / rel).exists() or not filecmp.cmp(Path(tmp) / rel, REPO_ROOT / rel, shallow=False)]
        stale += [str(rel) for rel in committed - set(fresh)]
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs (run `python -m hetero_infer.protogen`):", *stale, sep="\n  ")
            return 1
        print("generated stubs are up to date")
        return 0
    for rel in generate(REPO_ROOT):
        print("wrote", rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
