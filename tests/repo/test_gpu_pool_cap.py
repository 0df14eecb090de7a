"""Every engine a GPU test builds has a capped KV pool.

Unset, `max_num_blocks` lets a CUDA pool take `gpu_memory_utilization` of the device
(hetero_common/device_defaults.py): about 125 GiB on an H200. A GPU test that builds a second
engine beside one, clones the cache or offloads it to host memory then runs out of memory, and
the one device call of a session is lost. So every `Config(...)` in tests/gpu that names a
model (what an engine or a runner is built from) must set `max_num_blocks`.
"""

from __future__ import annotations

import ast
from pathlib import Path

GPU_TESTS = Path(__file__).resolve().parents[2] / "tests" / "gpu"


def uncapped_configs(source: str, filename: str = "<test>") -> list[str]:
    """'file:line' of each `Config(...)` call that passes `model=` but not `max_num_blocks=`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        keywords = {k.arg for k in node.keywords}
        if callee == "Config" and "model" in keywords and "max_num_blocks" not in keywords:
            found.append(f"{filename}:{node.lineno}")
    return found


def test_every_gpu_test_engine_caps_its_kv_pool() -> None:
    files = sorted(GPU_TESTS.glob("*.py"))
    assert files, f"no GPU tests under {GPU_TESTS}"
    uncapped = [where for path in files for where in uncapped_configs(path.read_text(), path.name)]
    assert not uncapped, ("these GPU test configs leave the KV pool to the device's memory; set max_num_blocks "
                          "(tests/gpu/test_gpu.py's GPU_TEST_BLOCKS):\n" + "\n".join(uncapped))


def test_the_check_finds_an_uncapped_engine() -> None:
    planted = ("engine = InferenceEngine(Config(model=str(d), device='cuda', block_size=16).validate())\n"
               "capped = Config(model=str(d), device='cuda', max_num_blocks=64)\n"
               "no_engine = Config(device='cuda', data_parallel_size=2)\n")
    assert uncapped_configs(planted) == ["<test>:1"]
