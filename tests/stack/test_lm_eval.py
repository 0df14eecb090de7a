"""lm-evaluation-harness end to end against the stack on SmolLM2, offline.

`lm_eval --model local-completions` scores a multiple-choice likelihood task (every choice by
`echo` + `logprobs`, which needs prompt logprobs) and runs a `generate_until` task, with the
remote tokenizer it probes on /tokenizer_info and /tokenize. The same tasks run through
lm_eval's own `hf` model (transformers on the same GGUF weights) are the oracle: the
per-choice loglikelihoods and the generated texts must agree. The tasks and their data ship
in tests/helpers/lm_eval_tasks/; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_common.model_files import default_model_path
from hetero_infer.bench.harness import run_stack

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval", reason="lm-evaluation-harness is a test extra (scripts/test.sh installs it)")

TASKS_DIR = Path(__file__).resolve().parents[1] / "helpers" / "lm_eval_tasks"
TASKS = "hetero_mc,hetero_gen"


def _lm_eval(model: str, model_args: str, out_dir: Path) -> tuple[dict, dict[str, list[dict]], str]:
    """Run lm_eval; return (results, samples per task, its log)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out_dir / "datasets-cache"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", TASKS,
           "--include_path", str(TASKS_DIR), "--output_path", str(out_dir), "--log_samples", "--batch_size", "1"]
    out = subprocess.run(cmd, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    results_files = sorted(out_dir.rglob("results_*.json"))
    assert results_files, log[-3000:]
    results = json.loads(results_files[-1].read_text())["results"]
    samples = {}
    for task in TASKS.split(","):
        files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
        assert files, f"no samples for {task}"
        samples[task] = sorted((json.loads(line) for line in files[-1].read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return results, samples, log


def test_lm_eval_local_completions_matches_transformers(tmp_path: Path) -> None:
    gguf = default_model_path()
    with run_stack(None) as stack:
        base_url = f"{stack.http_url}/v1/completions"
        # tokenizer_backend=auto: lm_eval probes /tokenizer_info and /tokenize and picks the remote tokenizer.
        ours, our_samples, log = _lm_eval("local-completions",
                                          f"base_url={base_url},model=SmolLM2-135M-Instruct,tokenizer_backend=auto,"
                                          "max_length=2048,num_concurrent=1,max_retries=1",
                                          tmp_path / "stack")
    assert "Auto-detected remote tokenizer support" in log, log[-3000:]
    oracle, oracle_samples, _ = _lm_eval("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
                                         tmp_path / "hf")

    for ours_s, theirs_s in zip(our_samples["hetero_mc"], oracle_samples["hetero_mc"], strict=True):
        assert ours_s["arguments"] == theirs_s["arguments"]
        our_ll = [float(r[0][0]) for r in ours_s["resps"]]
        their_ll = [float(r[0][0]) for r in theirs_s["resps"]]
        assert our_ll == pytest.approx(their_ll, abs=2e-3), ours_s["doc"]
    assert ours["hetero_mc"]["acc,none"] == oracle["hetero_mc"]["acc,none"]
    assert ours["hetero_mc"]["acc,none"] >= 0.5  # the easy facts: a broken scorer lands near chance

    our_texts = [s["resps"][0][0] for s in our_samples["hetero_gen"]]
    their_texts = [s["resps"][0][0] for s in oracle_samples["hetero_gen"]]
    assert our_texts == their_texts
    assert ours["hetero_gen"]["exact_match,none"] == oracle["hetero_gen"]["exact_match,none"]
