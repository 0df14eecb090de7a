"""What the GPU machine can import: its image's packages plus what scripts/gpu_carry.sh carries,
checked against the third-party imports of the code that runs there.

The carried requirements are read from the script's own `pip download` commands (so the check
sees exactly what the script fetches); the image's packages from scripts/gpu_image_packages.txt
(a copy of the device tool's KINDS.md list). Distribution names are compared normalized (PEP 503).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers.import_graph import external_imports, module_files, reachable_modules

RUNTIME_PACKAGES = ("hetero", "hetero_common", "gateway", "scheduler_svc", "gpu_worker", "kernels", "hetero_infer")
# What runs on the GPU machine besides the runtime: scripts/gpu_run.sh's tests, benchmarks and JIT
# build, and the conftest pytest loads first.
GPU_ENTRY_POINTS = ("tests.conftest", "tests.gpu.test_gpu", "tests.gpu.test_gpu_worker_paths", "tests.unit.gpu_worker.test_gpu_logic", "benchmarks.gpu_bench",
                    "benchmarks.step_cost", "benchmarks.gpu_perf_rows", "benchmarks.lora", "benchmarks.speculative",
                    "scripts.flashinfer_jit",
                    "scripts.wheel_tree")
# Import names that no installed distribution here declares (flashinfer is an optional extra).
IMPORT_TO_DISTRIBUTION = {"flashinfer": "flashinfer-python", "tvm_ffi": "apache-tvm-ffi"}
# flashinfer-python's requirements left out on purpose: nothing imports them when it is imported
# or JIT-compiles the paged attention kernels used here, and they would not fit the carry limit.
NOT_CARRIED = {"flashinfer-python": {"cuda-python", "cuda-tile", "nccl-extensions", "nccl4py",
                                     "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"}}
# Imports of commands the GPU run never runs, each imported lazily inside its command (so nothing the
# GPU machine imports loads it): the distribution and the one module allowed to import it.
OPERATOR_ONLY = {"cryptography": "hetero_infer.internal_certs"}  # `hetero-infer internal-certs`, run where certs are made
# The GPU machine's interpreter, for environment markers in requirements.
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_requirements(script: Path) -> dict[str, Requirement]:
    """Normalized name -> requirement, for every package a `pip download` line of the script names."""
    text = script.read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, flags=re.M))  # NAME=${NAME:-default}
    found: dict[str, Requirement] = {}
    for line in text.splitlines():
        if "pip download" not in line:
            continue
        words = iter(shlex.split(line.split("pip download", 1)[1], comments=True))
        for word in words:
            if word in ("-d", "--dest"):
                next(words, None)  # the folder
            elif not word.startswith(("-", "$")):  # options, "${target[@]}"
                for name, value in variables.items():
                    word = word.replace(f"${{{name}}}", value).replace(f"${name}", value)
                requirement = Requirement(word)
                found[normalize(requirement.name)] = requirement
    return found


def image_packages(listing: Path) -> set[str]:
    return {normalize(line.strip()) for line in listing.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


@dataclass(frozen=True)
class Uncovered:
    distribution: str
    needed_by: str  # "module:line" of an import, or the carried distribution that requires it


def gpu_imports(root: Path) -> dict[str, list[str]]:
    """Distribution -> where it is imported, for every third-party import of the runtime packages
    and the GPU entry points (and every project module they import)."""
    modules = module_files(root, (*RUNTIME_PACKAGES, "tests", "benchmarks", "scripts"))
    entry = [m for m in modules if m.split(".")[0] in RUNTIME_PACKAGES] + list(GPU_ENTRY_POINTS)
    owners = packages_distributions()
    found: dict[str, list[str]] = {}
    for module in reachable_modules(entry, modules):
        for name, line in external_imports(modules[module], modules):
            if name in sys.stdlib_module_names or name == "__future__":
                continue
            dists = IMPORT_TO_DISTRIBUTION.get(name) or (owners.get(name) or [name])[0]
            found.setdefault(normalize(dists), []).append(f"{module}:{line}")
    return found


def requirements_of(name: str) -> list[Requirement] | None:
    """A distribution's requirements that apply on the GPU machine (None: not installed here)."""
    try:
        declared = distribution(name).requires or []
    except PackageNotFoundError:
        return None
    requirements = [Requirement(r) for r in declared]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(GPU_PYTHON)]


def uncovered(root: Path, carried: dict[str, Requirement], image: set[str]) -> list[Uncovered]:
    """Imports (and requirements of carried distributions, as installed here) that neither the
    carry nor the image provides."""
    available = set(carried) | image
    missing = [Uncovered(dist, where[0]) for dist, where in sorted(gpu_imports(root).items())
               if dist not in available and not all(w.startswith(f"{OPERATOR_ONLY.get(dist)}:") for w in where)]
    for name in sorted(carried):
        for requirement in requirements_of(name) or []:
            needed = normalize(requirement.name)
            if needed not in available and needed not in NOT_CARRIED.get(name, set()):
                missing.append(Uncovered(needed, f"{name} requires {requirement}"))
    return missing
