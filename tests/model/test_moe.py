"""The mixtures of experts (Mixtral, Qwen3-MoE with a dense layer, Qwen2-MoE with its shared expert, OLMoE with
its all-heads q/k norm) against Hugging Face `transformers` on the same weights, from their directories and from
GGUF files of them: the config's expert facts, float32 logits and greedy tokens on the torch path, bfloat16 logits
through the C kernels, experts computed from Q8_0 blocks, the expert load the model counts, and what is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu.worker_setup import cpu_flags
from gpu_worker.lora.lora_adapter import load_lora_adapter
from gpu_worker.models.checkpoint import CheckpointError, load_checkpoint
from gpu_worker.models.model import LlamaModel
from gpu_worker.models.moe import GroupedExperts
from hetero_common.config import Config
from hetero_common.config_sections import TokenizerConfig
from hetero_common.errors import HeteroError
from hetero_infer.engine import GenerationParams, InferenceEngine
from kernels.cache_ops import allocate_kv_cache
from kernels.native import decode_attention as native_decode
from kernels.native import linear as native_linear
from kernels.native import linear_gguf
from kernels.native.linear_gguf import GGUFPackedWeight
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from hetero_infer.bench.gguf_writer import write_gguf
from tests.helpers.oracle import engine_greedy, hf_greedy, hf_last_logits, make_prompts
from tests.helpers.tiny_models import make_head64_qwen3_moe, make_lora_adapter
from tests.unit.gpu_worker.test_cpu_dtype import REL_TOL, prefill_logits

FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"]
# (experts, top-k, renormalized, expert size, sparse layers, shared expert size): what tiny_models builds
EXPECTED = {"mixtral": (4, 2, True, 64, (0, 1), 0), "qwen3_moe": (8, 3, True, 48, (0, 2), 0),
            "qwen2_moe": (4, 2, False, 48, (0, 1), 80), "olmoe": (8, 2, False, 64, (0, 1), 0)}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_experts(tiny_moe_dirs: dict[str, Path], family: str) -> None:
    config, state = load_checkpoint(tiny_moe_dirs[family])
    moe = config.moe
    assert config.architecture == family and moe is not None
    assert (moe.num_experts, moe.top_k, moe.normalize_top_k, moe.expert_intermediate_size, moe.sparse_layers,
            moe.shared_expert_intermediate_size) == EXPECTED[family]
    last = moe.num_experts - 1
    assert state[f"model.layers.0.mlp.experts.{last}.down_proj.weight"].shape == (96, moe.expert_intermediate_size)
    assert state["model.layers.0.mlp.gate.weight"].shape == (moe.num_experts, 96)


def test_mixtral_checkpoint_names_become_the_engines(tiny_moe_dirs: dict[str, Path]) -> None:
    """w1 is the gate product, w3 up, w2 down; a loader that mixed them up would still run."""
    from safetensors.torch import load_file

    _, state = load_checkpoint(tiny_moe_dirs["mixtral"])
    raw = load_file(str(tiny_moe_dirs["mixtral"] / "model.safetensors"))
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        assert torch.equal(state[f"model.layers.1.mlp.experts.2.{ours}.weight"],
                           raw[f"model.layers.1.block_sparse_moe.experts.2.{theirs}.weight"])
    assert torch.equal(state["model.layers.1.mlp.gate.weight"], raw["model.layers.1.block_sparse_moe.gate.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(tiny_moe_dirs: dict[str, Path], family: str) -> None:
    prompts = make_prompts()
    torch.testing.assert_close(prefill_logits(tiny_moe_dirs[family], torch.float32, prompts),
                               hf_last_logits(tiny_moe_dirs[family], prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_moe_dirs: dict[str, Path], family: str, block_size: int) -> None:
    prompts = make_prompts()
    assert engine_greedy(tiny_moe_dirs[family], prompts, block_size=block_size) == hf_greedy(tiny_moe_dirs[family],
                                                                                            prompts)


def test_the_model_counts_each_experts_tokens(tiny_moe_dirs: dict[str, Path]) -> None:
    """Every token goes to top-k experts in each sparse layer: the step's load sums to tokens x k x layers, and
    the routers spread it (no expert takes all)."""
    config, weights = load_checkpoint(tiny_moe_dirs["qwen3_moe"])
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32, max_positions=512)
    tokens = torch.arange(2, 42)
    x = model._embed(tokens)
    layer = model.layers[0]
    out, load = layer["moe"](x, lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])
    assert out.shape == x.shape and int(load.sum()) == 40 * 3 and int(load.max()) < 40
    assert model.take_expert_load() is None  # nothing ran through the model's own forward yet


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_lora_on_the_experts_is_refused_by_name(tiny_moe_dirs: dict[str, Path], family: str, tmp_path: Path) -> None:
    config, _ = load_checkpoint(tiny_moe_dirs[family])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                             "target_modules": ["q_proj", "down_proj"]}))
    with pytest.raises(HeteroError, match=r"\['down_proj'\].*mixtures of experts"):
        load_lora_adapter("a", adapter, config, max_rank=8)


def test_lora_on_a_mixture_of_experts_attention_is_served(tiny_moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    config, _ = load_checkpoint(tiny_moe_dirs["mixtral"])
    adapter = make_lora_adapter(tiny_moe_dirs["mixtral"], tmp_path / "attn", rank=4, targets=["q_proj", "v_proj"])
    assert load_lora_adapter("a", adapter, config, max_rank=8).targets == {"q_proj", "v_proj"}


@pytest.mark.parametrize("edit, why", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok <= num_experts"),
    ({"clip_qkv": 8.0}, "clip_qkv"),
    ({"num_experts": None}, "num_experts"),
])
def test_unservable_expert_settings_are_refused_by_name(tiny_moe_dirs: dict[str, Path], tmp_path: Path, edit: dict,
                                                       why: str) -> None:
    directory = shutil.copytree(tiny_moe_dirs["olmoe"], tmp_path / "edited")
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(CheckpointError, match=why):
        load_checkpoint(directory)


REASON = native_linear.unavailable_reason(cpu_flags())
BLOCK = 16


@pytest.fixture(scope="module")
def head64_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_head64_qwen3_moe(tmp_path_factory.mktemp("head64-qwen3-moe"))


@pytest.mark.skipif(REASON is not None, reason=f"the C linear kernel does not run here: {REASON}")
@pytest.mark.skipif(not native_decode.takes_prompts(64, 16), reason="the C attention has no AVX512-BF16 path here")
def test_bfloat16_c_kernels_close_to_transformers(head64_moe_dir: Path) -> None:
    """The experts' products through the C linear kernel over each expert's group, the layers one by one."""
    config, weights = load_checkpoint(head64_moe_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=True, fused=True)
    assert model.elementwise == "c" and model.c_layers is None
    prompts = [list(range(2, 22)), list(range(40, 75))]
    cache = allocate_kv_cache(config.num_hidden_layers, 8, BLOCK, model.num_kv_heads, config.head_dim,
                              torch.bfloat16, "cpu", TorchPagedAttention.kv_layout)
    attention = TorchPagedAttention(model.num_heads, model.num_kv_heads, config.head_dim, decode_kernel="c",
                                    dtype=torch.bfloat16)
    lens = np.array([len(p) for p in prompts])
    table = PageTable.build([np.array([3, 1], dtype=np.int32), np.array([0, 5, 6], dtype=np.int32)], lens, lens, BLOCK)
    attention.plan(table)
    positions, slots = table.token_positions()
    ids = torch.tensor([t for p in prompts for t in p])
    rows = table.qo_indptr[1:].to(torch.int64) - 1
    with torch.inference_mode():
        fast = model.forward(ids, torch.from_numpy(positions), torch.from_numpy(slots), cache, attention, rows)
    load = model.take_expert_load()
    assert load is not None and int(load.sum()) == len(ids) * 2 * 2  # top-2 in layers 0 and 2
    exact = hf_last_logits(head64_moe_dir, prompts)
    rel = (fast - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(rel.max()) < REL_TOL, rel
    # the token bfloat16 picks is transformers' best or within bfloat16's rounding of it (random logits tie)
    picked = exact.gather(1, fast.argmax(-1, keepdim=True)).squeeze(1)
    assert bool((picked >= exact.max(-1).values - 0.02).all()), (picked, exact.max(-1).values)


# --- GGUF files, written from the same weights as llama.cpp's converter writes them ----------------------------


@pytest.fixture(scope="module")
def moe_ggufs(tiny_moe_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("moe-gguf")
    return {family: write_gguf(tiny_moe_dirs[family], directory / f"{family}.gguf") for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_file_has_the_directorys_config_and_weights(tiny_moe_dirs: dict[str, Path], moe_ggufs: dict[str, Path],
                                                         family: str) -> None:
    """The stacked ffn_*_exps split per expert, the router and shared expert renamed, Mixtral's `llama` file with
    experts told apart from a Llama, its Q/K rows un-permuted."""
    config, state = load_checkpoint(moe_ggufs[family])
    reference_config, reference = load_checkpoint(tiny_moe_dirs[family])
    assert config == reference_config
    assert set(state) == set(reference)
    assert all(torch.equal(state[name], reference[name]) for name in reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_greedy_matches_transformers(tiny_moe_dirs: dict[str, Path], moe_ggufs: dict[str, Path],
                                          family: str) -> None:
    prompts = make_prompts()
    ours = engine_greedy(moe_ggufs[family], prompts, block_size=16, tokenizer=TokenizerConfig(path=str(
        tiny_moe_dirs[family])))
    assert ours == hf_greedy(tiny_moe_dirs[family], prompts)


@pytest.mark.skipif(not linear_gguf.supported(linear_gguf.Q8_0, 16, 32),
                    reason="the GGUF kernel does not run here (AVX512-VNNI)")
def test_expert_products_are_served_from_their_gguf_blocks(head64_moe_dir: Path, tmp_path: Path) -> None:
    """`quantization: auto` on a Q8_0 file: every expert's products computed from the file's blocks by the GGUF
    kernel; greedy tokens agree with the same file dequantized and run in float32 (a random model's logits tie
    often enough in bfloat16 that some streams part before their end)."""
    path = write_gguf(head64_moe_dir, tmp_path / "q8.gguf", quantize="Q8_0")
    prompts = make_prompts()
    params = GenerationParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**overrides) -> tuple[InferenceEngine, list[list[int]]]:
        engine = InferenceEngine(Config(model=str(path), tokenizer=TokenizerConfig(path=str(head64_moe_dir)),
                                        block_size=16, **overrides).validate())
        ids = [engine.submit_request(p, params) for p in prompts]
        done = {r.request_id: r.output_token_ids for r in engine.run()}
        return engine, [done[i] for i in ids]

    served, ours = run(quantization="auto")
    model = served.runner.model
    experts = [w for layer in (0, 2) for w in model.layers[layer]["moe"].products()[1:]]
    assert len(experts) == 2 * 2 * 8 and all(type(w) is GGUFPackedWeight for w in experts)
    _, reference = run(quantization="none", dtype="float32")
    agreed = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, reference))
    assert agreed >= 0.75 * 24 * len(prompts), (agreed, ours, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_products_cudas_path_computes_what_the_per_expert_loop_does(tiny_moe_dirs: dict[str, Path],
                                                                                dtype: torch.dtype) -> None:
    """CUDA's path (the experts stacked, two grouped products over the step's pairs sorted by expert, no host
    read-back), run here on torch's CPU grouped product: the per-expert loop's output and expert load."""
    config, weights = load_checkpoint(tiny_moe_dirs["qwen2_moe"])
    model = LlamaModel(config, weights, torch.device("cpu"), dtype, max_positions=512)
    moe = model.layers[1]["moe"]
    x = model._embed(torch.arange(2, 63)) * 30

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    loop, loop_load = moe(x, silu_mul)
    moe.grouped, experts = GroupedExperts.stack(moe.experts), moe.experts
    moe.experts = []
    grouped, grouped_load = moe(x, silu_mul)
    assert torch.equal(loop_load, grouped_load) and int(loop_load.min()) > 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=tolerance, atol=tolerance * float(loop.abs().max()))
    empty, load = moe(x[:0], silu_mul)
    assert empty.shape == (0, 96) and int(load.sum()) == 0
    assert len(experts) == 4
