"""The fused element-wise kernels' selection (gpu_worker/models/model.py `elementwise_ops`, kernels/flashinfer_fused.py)
on the CPU: FlashInfer's serve CUDA alone, the CPU keeps its C kernels or torch's ops, and config
`use_flashinfer_fused_rope` changes nothing on a CPU. The kernels themselves run in tests/gpu/test_gpu_worker_paths.py."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.cpu import fused_ops
from gpu_worker.models.model import elementwise_ops
from gpu_worker.models.model_build import fused_elementwise
from hetero_common.config import Config
from kernels import flashinfer_fused


def test_flashinfer_kernels_serve_cuda_alone() -> None:
    assert not flashinfer_fused.available(torch.device("cpu"), torch.bfloat16)
    assert not flashinfer_fused.available(torch.device("cuda"), torch.float32)  # 16-bit only
    assert elementwise_ops(True, torch.device("cpu"), torch.float32) is None
    expected = fused_ops if fused_ops.available(torch.device("cpu"), torch.bfloat16) else None
    assert elementwise_ops(True, torch.device("cpu"), torch.bfloat16) is expected
    assert elementwise_ops(False, torch.device("cpu"), torch.bfloat16) is None


def test_the_key_decides_on_cuda_and_cpu_kernels_on_the_cpu() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused_elementwise(Config(use_flashinfer_fused_rope=True).validate(), cuda)
    assert not fused_elementwise(Config(use_flashinfer_fused_rope=False).validate(), cuda)
    assert fused_elementwise(Config(use_flashinfer_fused_rope=False).validate(), cpu)  # cpu_kernels auto
    assert not fused_elementwise(Config(cpu_kernels="torch").validate(), cpu)


def test_cos_sin_cache_is_flashinfers_layout() -> None:
    cos, sin = torch.rand(10, 4, dtype=torch.bfloat16), torch.rand(10, 4, dtype=torch.bfloat16)
    table = flashinfer_fused.cos_sin_cache(cos, sin)
    assert table.dtype == torch.float32 and table.shape == (10, 8) and table.is_contiguous()
    assert torch.equal(table[:, :4], cos.float()) and torch.equal(table[:, 4:], sin.float())


def test_a_cpu_model_is_the_same_with_the_key_on_or_off(tiny_llama_dir: Path) -> None:
    from hetero_infer.engine import GenerationParams, InferenceEngine

    outputs = []
    for on in (True, False):
        engine = InferenceEngine(Config(model=str(tiny_llama_dir), dtype="float32",
                                        use_flashinfer_fused_rope=on).validate())
        assert engine.runner.model.elementwise == "torch"
        request = engine.submit_request([5, 6, 7, 8], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        outputs.append({r.request_id: r.output_token_ids for r in engine.run()}[request])
    assert outputs[0] == outputs[1]


def test_the_model_does_not_import_flashinfer_until_cuda_asks() -> None:
    """CPU machines never need flashinfer: importing the model (and the fused module) leaves it unimported."""
    import subprocess
    import sys

    code = "import sys, gpu_worker.models.model, kernels.flashinfer_fused; print('flashinfer' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_an_empty_step_launches_nothing() -> None:
    """No rows, no kernel (a grid of no blocks is a launch error): shapes only, so CPU tensors do, and flashinfer's
    modules are never asked for."""
    hidden, weight = torch.empty(0, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    assert flashinfer_fused.add_rms_norm(hidden, None, weight, 1e-5).shape == (0, 8)
    delta = torch.empty(0, 8, dtype=torch.bfloat16)
    assert flashinfer_fused.add_rms_norm(hidden, delta, weight, 1e-5) is delta  # the normed rows go over delta
    flashinfer_fused.rope_(torch.empty(0, 4 * 8, dtype=torch.bfloat16), 2, 1, 8, torch.empty(0, dtype=torch.int64),
                           torch.empty(4, 8))
    assert flashinfer_fused.silu_mul(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0, 8)
