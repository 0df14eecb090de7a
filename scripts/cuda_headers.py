"""Install only the C headers of NVIDIA's CUDA library wheels, for compiling without a GPU.

    python scripts/cuda_headers.py nvidia-cublas==13.10.0.20 [...]

FlashInfer's `norm` module (kernels/flashinfer_fused.py) includes cublasLt.h. A CUDA install with nvcc and
the runtime alone (the CI image's) has no cuBLAS, and its wheel is 440 MiB of libraries around six
headers: this downloads the wheel once (kept in build/wheels/) and unpacks its `nvidia/*/include/*.h`
into this interpreter's site-packages, where FlashInfer's JIT already looks (`-isystem
.../nvidia/cu13/include`, as for cuRAND's headers). Nothing else of the wheel is installed.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(requirements: list[str]) -> int:
    cache = ROOT / "build" / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    site = Path(sysconfig.get_paths()["purelib"])
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        pattern = f"{name.replace('-', '_')}-{version}-*.whl" if version else f"{name.replace('-', '_')}-*.whl"
        if not list(cache.glob(pattern)):
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache),
                            requirement], check=True)
        wheel = sorted(cache.glob(pattern))[-1]
        with zipfile.ZipFile(wheel) as archive:
            headers = [n for n in archive.namelist() if n.startswith("nvidia/") and "/include/" in n and n.endswith(".h")]
            if not headers:
                raise SystemExit(f"{wheel.name} holds no nvidia/*/include/*.h")
            for member in headers:
                archive.extract(member, site)
        print(f"{requirement}: {len(headers)} headers into {site / Path(headers[0]).parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
