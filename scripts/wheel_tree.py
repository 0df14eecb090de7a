"""Carry wheels to an offline machine as one solidly compressed tree, and turn it back into wheels there.

    python scripts/wheel_tree.py pack WHEEL_DIR ARCHIVE.tar.xz    # each wheel unpacked under <wheel file name>/
    python scripts/wheel_tree.py unpack ARCHIVE.tar.xz WHEEL_DIR  # the same wheels again (stored, uncompressed)

Why: a wheel compresses file by file; flashinfer-python 0.7.2.post1 is a 59 MiB wheel of ~10,000
mostly-text files (426 MiB unpacked) that xz compresses, as one stream, to about 17 MiB, which fits
the GPU machine's 64 MiB carry limit with room for the other wheels. The rebuilt wheels hold the
same files byte for byte, so `pip install --no-index --no-deps --target` installs them as usual.
Standard library only (the `xz` program is used for packing when present: multi-threaded).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path


def pack(wheel_dir: Path, archive: Path) -> None:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {wheel_dir}")
    xz = None
    if shutil.which("xz"):  # stream the tar through a multi-threaded xz
        out = open(archive, "wb")
        xz = subprocess.Popen(["xz", "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
        tar = tarfile.open(fileobj=xz.stdin, mode="w|")
    else:
        tar = tarfile.open(archive, "w:xz", preset=6)
    with tar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    data = zf.read(info)
                    member = tarfile.TarInfo(f"{wheel.name}/{info.filename}")
                    member.size = len(data)
                    member.mtime = 0
                    member.mode = (info.external_attr >> 16) & 0o777 or 0o644
                    tar.addfile(member, io.BytesIO(data))
    if xz is not None:
        xz.stdin.close()
        if xz.wait() != 0:
            raise SystemExit("xz failed")
        out.close()
    print(f"{archive}: {len(wheels)} wheels, {archive.stat().st_size / 2**20:.1f} MiB")


def unpack(archive: Path, wheel_dir: Path) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[str, zipfile.ZipFile] = {}
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            name, _, inner = member.name.partition("/")
            if not name.endswith(".whl") or not inner or ".." in Path(inner).parts:
                raise SystemExit(f"{archive}: unexpected member {member.name!r}")
            if name not in writers:
                writers[name] = zipfile.ZipFile(wheel_dir / name, "w", compression=zipfile.ZIP_STORED)
            info = zipfile.ZipInfo(inner, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (member.mode & 0o777) << 16
            writers[name].writestr(info, tar.extractfile(member).read())
    for zf in writers.values():
        zf.close()
    print(f"{wheel_dir}: {', '.join(sorted(writers))}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        raise SystemExit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
