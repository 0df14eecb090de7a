"""LoRA adapters in PEFT's format (gpu_worker/lora/lora_adapter.py, issue 41): what one adds to each target is
PEFT's own (its merged weights are the oracle: base + scaling * B @ A, with lora_alpha / r or rsLoRA's
lora_alpha / sqrt(r)), for ranks 8 and 64 and different target sets; every adapter this engine would not
compute exactly is refused with an error naming what is wrong. A load at run time must lie under lora_root
(symlinks followed), and crafted, damaged or oversized files are refused with a LoraAdapterError before their
tensors are read (issue 58)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from gpu_worker.lora.adapter_files import run_time_root
from gpu_worker.lora.lora_adapter import LoraAdapter, LoraAdapterError, load_lora_adapter
from gpu_worker.lora.lora_slots import LoraSlots
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.parallel.tensor_parallel import TensorParallel
from gpu_worker.service import WorkerServicer, load_lora_on_rank
from hetero.v1 import worker_pb2
from hetero_infer.bench.harness import make_random_llama, make_tiny_llama
from tests.helpers.tiny_models import make_lora_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=1)


def merged_delta(base: Path, adapter: Path, module: str) -> torch.Tensor:
    """PEFT's merged weight of `module` minus the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    before = dict(model.named_parameters())[f"{module}.weight"].detach().clone()
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return dict(merged.named_parameters())[f"{module}.weight"].detach() - before


@pytest.mark.parametrize("rank,targets,rslora", [(8, ["q_proj", "v_proj"], False),
                                                 (64, ["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"], True)])
def test_an_adapter_adds_what_peft_merges(base: Path, tmp_path: Path, rank: int, targets: list[str],
                                          rslora: bool) -> None:
    directory = make_lora_adapter(base, tmp_path / "adapter", rank, targets, seed=rank, alpha=32, rslora=rslora)
    config, _ = load_checkpoint(base)
    adapter = load_lora_adapter("a", directory, config, max_rank=64)
    assert adapter.rank == rank and adapter.targets == set(targets)
    assert adapter.scaling == pytest.approx(32 / rank ** 0.5 if rslora else 32 / rank)
    for target in targets:
        kind = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        a, b = adapter.weights[(1, target)]
        expected = merged_delta(base, directory, f"model.layers.1.{kind}.{target}")
        torch.testing.assert_close(adapter.scaling * b @ a, expected, rtol=1e-4, atol=1e-5)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    settings = json.loads(path.read_text())
    settings.update(changes)
    path.write_text(json.dumps(settings))


@pytest.mark.parametrize("changes,words", [
    (dict(r=16), "lora_A (8, 64)"),  # the file's shapes are rank 8's
    (dict(use_dora=True), "DoRA is not served"),
    (dict(bias="all"), "bias = 'all'"),
    (dict(target_modules=["q_proj", "lm_head"]), "['lm_head'] are not modules of the served model"),
    (dict(target_modules=["q_proj", "k_proj"]), "targets ['k_proj']"),
    (dict(peft_type="PREFIX_TUNING"), "peft_type 'PREFIX_TUNING'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 4}), "per-module ranks"),
])
def test_an_adapter_asking_for_what_is_not_served_is_refused(base: Path, tmp_path: Path, changes: dict,
                                                             words: str) -> None:
    directory = make_lora_adapter(base, tmp_path / "adapter", 8, ["q_proj"])
    edit_config(directory, **changes)
    config, _ = load_checkpoint(base)
    with pytest.raises(LoraAdapterError, match="LoRA adapter 'bad'.*" + re.escape(words)):
        load_lora_adapter("bad", directory, config, max_rank=64)


def test_missing_files_a_rank_over_the_limit_and_another_base_are_refused(base: Path, tmp_path: Path) -> None:
    config, _ = load_checkpoint(base)
    with pytest.raises(LoraAdapterError, match="adapter_config.json.* is missing"):
        load_lora_adapter("gone", tmp_path / "nowhere", config, max_rank=64)
    directory = make_lora_adapter(base, tmp_path / "big", 32, ["q_proj"])
    with pytest.raises(LoraAdapterError, match=r"rank 32 is over max_lora_rank \(16\)"):
        load_lora_adapter("big", directory, config, max_rank=16)
    (directory / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors' is missing"):
        load_lora_adapter("big", directory, config, max_rank=64)
    other = make_random_llama(tmp_path / "other", hidden=96, intermediate=128, layers=2, heads=4, kv_heads=2,
                              vocab=512)
    foreign = make_lora_adapter(other, tmp_path / "foreign", 8, ["q_proj"])
    with pytest.raises(LoraAdapterError, match="trained for another base model"):
        load_lora_adapter("foreign", foreign, config, max_rank=64)


# --- Untrusted files (issue 58): a run-time load lies under lora_root; whatever the files hold, the answer is a
# LoraAdapterError that says what to fix, and nothing large is read before the header is checked ---

@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter (rank 8, q_proj and v_proj) to copy into each test's lora_root."""
    return make_lora_adapter(base, tmp_path_factory.mktemp("lora-good") / "adapter", 8, ["q_proj", "v_proj"], seed=2)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return (tmp_path / "root").resolve()


def under_root(good: Path, root: Path, name: str = "a") -> Path:
    return Path(shutil.copytree(good, root / name))


def load_under(name: str, path: str | Path, root: Path, base: Path) -> LoraAdapter:
    config, _ = load_checkpoint(base)
    return load_lora_adapter(name, path, config, max_rank=64, root=run_time_root(str(root), name))


def refused_under(path: str | Path, root: Path, base: Path, *words: str) -> str:
    with pytest.raises(LoraAdapterError) as info:
        load_under("x", path, root, base)
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_an_adapter_under_lora_root_loads_by_its_path_or_relative_to_the_root(base: Path, good: Path,
                                                                              root: Path) -> None:
    config, _ = load_checkpoint(base)
    trusted = load_lora_adapter("a", good, config, max_rank=64)
    under_root(good, root)
    (root / "inner").symlink_to(root / "a")  # a symlink that stays under the root is fine
    (root / "x").mkdir()
    for path in (root / "a", "a", root / "inner", "inner", root / "x" / ".." / "a"):
        adapter = load_under("a", path, root, base)
        assert (adapter.rank, adapter.targets, adapter.scaling) == (trusted.rank, trusted.targets, trusted.scaling)
        for key, (a, b) in trusted.weights.items():
            assert torch.equal(adapter.weights[key][0], a) and torch.equal(adapter.weights[key][1], b)


def test_a_path_outside_lora_root_is_refused_and_whether_it_exists_is_not_told(base: Path, good: Path,
                                                                               root: Path, tmp_path: Path) -> None:
    elsewhere = Path(shutil.copytree(good, tmp_path / "elsewhere"))
    said = refused_under(elsewhere, root, base, "not under the worker's lora_root", str(elsewhere), "lora_modules")
    missing = refused_under(tmp_path / "nowhere", root, base, "not under the worker's lora_root")
    assert said.replace(str(elsewhere), "P") == missing.replace(str(tmp_path / "nowhere"), "P")
    refused_under(root / ".." / "elsewhere", root, base, "not under the worker's lora_root")  # `..` traversal
    refused_under("../elsewhere", root, base, "not under the worker's lora_root")
    refused_under("/etc", root, base, "not under the worker's lora_root")
    refused_under(root / "gone", root, base, "does not exist under the worker's lora_root")
    (root / "file").write_text("{}")
    refused_under(root / "file", root, base, "is not a directory")


def test_a_symlink_in_lora_root_leading_out_is_refused_without_naming_its_target(base: Path, good: Path,
                                                                                root: Path, tmp_path: Path) -> None:
    elsewhere = Path(shutil.copytree(good, tmp_path / "secret-place"))
    (root / "dirlink").symlink_to(elsewhere, target_is_directory=True)
    said = refused_under(root / "dirlink", root, base, "not under the worker's lora_root", str(root / "dirlink"))
    assert "secret-place" not in said
    refused_under("dirlink", root, base, "not under the worker's lora_root")
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        directory = under_root(good, root, f"filelink-{file}")
        (directory / file).unlink()
        (directory / file).symlink_to(elsewhere / file)
        said = refused_under(directory, root, base, "not under the worker's lora_root", file)
        assert "secret-place" not in said
    (root / "loop").symlink_to(root / "loop")
    refused_under(root / "loop", root, base, "lora_root")


def test_with_no_lora_root_run_time_loads_are_refused_and_lora_modules_still_load(base: Path, good: Path) -> None:
    config, _ = load_checkpoint(base)
    slots = LoraSlots(config, 2, 64, torch.device("cpu"), torch.float32, TensorParallel(), lora_root=None)
    with pytest.raises(LoraAdapterError, match="lora_root is not set; set lora_root"):
        slots.read("a", str(good), trusted=False)
    assert slots.load(1, "a", str(good), trusted=True).rank == 8  # the operator's own path (lora_modules)
    confined = LoraSlots(config, 2, 64, torch.device("cpu"), torch.float32, TensorParallel(),
                         lora_root=str(good.parent.parent))
    assert confined.load(1, "a", str(good), trusted=False).rank == 8
    with pytest.raises(LoraAdapterError, match="not under the worker's lora_root"):
        LoraSlots(config, 2, 64, torch.device("cpu"), torch.float32, TensorParallel(),
                  lora_root=str(good)).read("a", str(good.parent), trusted=False)


NESTED = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("text,words", [
    ('{"r": "x"}', "r = 'x' must be a positive integer"),
    ('{"r": -1}', "r = -1 must be a positive integer"),
    ('{"r": true}', "r = True must be a positive integer"),
    ('{"r": 1.5}', "must be a positive integer"),
    ('{"r": 8, "target_modules": 5}', "target_modules = 5 must be a list"),
    ('{"r": 8, "target_modules": [1, 2]}', "must be a list of module names"),
    ('{"r": 8, "target_modules": "(q_proj"}', "is not a valid regex"),
    ('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": {}}', "lora_alpha = {} must be a finite number"),
    ('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": NaN}', "not valid JSON"),
    ('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": Infinity}', "not valid JSON"),
    ('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": 1e999}', "lora_alpha = inf must be a finite number"),
    ('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": ' + "9" * 400 + "}", "must be a finite number"),
    ('{"r": 8, "target_modules": ["q_proj"], "use_rslora": "yes"}', "use_rslora = 'yes' must be true or false"),
    ('{"r": 8, "target_modules": ["q_proj"], "peft_type": ["LORA"]}', "peft_type ['LORA'] is not served"),
    ('{"r": 8, "target_modules": ["q_proj"], "bias": ' + NESTED + "}", "nests too deeply"),
    (NESTED, "nests too deeply"),
    ('{"r": 8, "target_modules": ["q_proj"], "bias": [' + ",".join(["1"] * 10_000) + "]}", "bias = [1, 1,"),
    ("[1, 2]", "must hold a JSON object"),
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    (b"\xff\xfe\x00garbage", "is not valid JSON"),
    ('{"r": 8, "target_modules": ["q_proj"], "pad": "' + "x" * (1 << 20) + '"}', "over the 1048576"),
])
def test_a_crafted_adapter_config_is_refused_with_what_is_wrong(base: Path, good: Path, root: Path, text,
                                                                words: str) -> None:
    directory = under_root(good, root)
    file = directory / "adapter_config.json"
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    said = refused_under(directory, root, base, "LoRA adapter 'x'", words)
    assert len(said) < 600  # a value from the file is shown cut short, whatever its size


def test_a_directory_or_a_fifo_where_a_file_should_be_is_refused(base: Path, good: Path, root: Path) -> None:
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        directory = under_root(good, root, f"dir-{file}")
        (directory / file).unlink()
        (directory / file).mkdir()
        refused_under(directory, root, base, file, "is not a regular file")
        directory = under_root(good, root, f"fifo-{file}")
        (directory / file).unlink()
        os.mkfifo(directory / file)  # an open that waited for a writer would hang the load forever
        refused_under(directory, root, base, file, "is not a regular file")
    directory = under_root(good, root, "unreadable")
    (directory / "adapter_model.safetensors").chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        refused_under(directory, root, base, "cannot open", "adapter_model.safetensors")


def write_safetensors(file: Path, header: dict, data: bytes, header_size: int | None = None) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if header_size is None else header_size) + raw + data)


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    size = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + size]), blob[8 + size:]


def test_a_crafted_or_damaged_safetensors_file_is_refused_before_its_tensors_are_read(
        base: Path, good: Path, root: Path) -> None:
    header, data = read_safetensors(good / "adapter_model.safetensors")
    key_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    key_b = key_a.replace("lora_A", "lora_B")
    begin, end = header[key_a]["data_offsets"]

    def crafted(name: str, new_header: dict, new_data: bytes = data, header_size: int | None = None) -> Path:
        directory = under_root(good, root, name)
        write_safetensors(directory / "adapter_model.safetensors", new_header, new_data, header_size)
        return directory

    def changed(key: str, **entry) -> dict:
        return {**header, key: {**header[key], **entry}}

    refused_under(crafted("huge-header", header, header_size=1 << 40), root, base,
                  "claims a 1099511627776-byte header, over the 16777216")
    refused_under(crafted("long-header", header, header_size=(1 << 20)), root, base, "is truncated")
    directory = under_root(good, root, "truncated")
    blob = (directory / "adapter_model.safetensors").read_bytes()
    for cut in (3, 100, len(blob) // 2, len(blob) - 1):
        (directory / "adapter_model.safetensors").write_bytes(blob[:cut])
        refused_under(directory, root, base, "adapter_model.safetensors", "truncated")
    refused_under(crafted("junk-after", header, data + b"\0" * 16), root, base, "16 bytes after its last tensor")
    directory = under_root(good, root, "sparse")
    with open(directory / "adapter_model.safetensors", "r+b") as file:
        file.truncate(64 << 20)  # sparse: costs no disk; far over what a rank-8 adapter of this model holds
    refused_under(directory, root, base, "more than any rank-8 adapter of the served model holds")
    refused_under(crafted("wide", changed(key_a, shape=[8, 65], data_offsets=[begin, begin + 8 * 65 * 4])),
                  root, base, "lora_A (8, 65)", "needs (8, 64)", "trained for another base model")
    refused_under(crafted("rank", changed(key_b, shape=[64, 4])), root, base, "lora_B (64, 4)", "needs (64, 8)")
    refused_under(crafted("dtype", changed(key_a, dtype="I64")), root, base, "as 'I64'", "F32")
    refused_under(crafted("dtype-size", changed(key_a, dtype="F16")), root, base, "F16 (8, 64) takes 1024")
    refused_under(crafted("shape", changed(key_a, shape="8x64")), root, base, "not a list of integers")
    refused_under(crafted("offsets", changed(key_a, data_offsets=[end, begin])), root, base, "not [begin, end]")
    refused_under(crafted("overlap", changed(key_a, data_offsets=[begin + 4, end + 4])), root, base, "overlapping")
    refused_under(crafted("entry", {**header, key_a: [1, 2]}), root, base, "not an object")

    def renamed(new_key: str) -> dict:
        return {(new_key if k == key_a else k): v for k, v in header.items()}

    refused_under(crafted("name", renamed("lm_head.weight")), root, base,
                  "'lm_head.weight', which is not a LoRA weight")
    refused_under(crafted("layer", renamed(key_a.replace("layers.0.", "layers.7."))), root, base,
                  "for layer 7, but the served model has 2 layers")
    refused_under(crafted("long-layer", renamed(key_a.replace("layers.0.", "layers." + "9" * 5000 + "."))), root,
                  base, "not a LoRA weight")
    refused_under(crafted("newline", renamed(key_a + "\n")), root, base, "not a LoRA weight")
    lone = {k: v for k, v in header.items() if k != key_b}
    lone_data = data[:header[key_b]["data_offsets"][0]] + data[header[key_b]["data_offsets"][1]:]
    lone = {k: {**v, "data_offsets": shift(v["data_offsets"], header[key_b]["data_offsets"])} if k != "__metadata__"
            else v for k, v in lone.items()}
    refused_under(crafted("lone", lone, lone_data), root, base, "layer 0 q_proj has lora_B missing")
    directory = under_root(good, root, "not-json")
    (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops" + data)
    refused_under(directory, root, base, "adapter_model.safetensors", "not valid JSON")
    refused_under(crafted("list", [1], b""), root, base, "not a JSON object")  # type: ignore[arg-type]
    directory = under_root(good, root, "duplicate")
    raw = json.dumps(header).encode()
    raw = raw[:-1] + b', "' + key_a.encode() + b'": ' + json.dumps(header[key_a]).encode() + b"}"
    (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    refused_under(directory, root, base, "appears twice")


def shift(offsets: list[int], removed: list[int]) -> list[int]:
    """`offsets` once the bytes `removed` are cut out of the data before them."""
    gap = removed[1] - removed[0]
    return [o - gap if o >= removed[1] else o for o in offsets]


def test_any_damage_to_either_file_is_a_lora_adapter_error(base: Path, good: Path, root: Path) -> None:
    """Random bytes flipped, cut or added anywhere in either file: it loads or is refused, never another
    exception (which would end a tensor-parallel worker)."""
    rng = random.Random(5)
    directory = under_root(good, root)
    originals = {f: (good / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}
    for _ in range(300):
        file = rng.choice(list(originals))
        blob = bytearray(originals[file])
        # Mostly in the JSON (the config, the header) where a change is read; sometimes anywhere.
        limit = len(blob) if file == "adapter_config.json" or rng.random() < 0.2 else \
            8 + struct.unpack("<Q", blob[:8])[0]
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(limit)
            kind = rng.random()
            if kind < 0.6:
                blob[at] = rng.randrange(256)
            elif kind < 0.8:
                del blob[at:at + rng.randint(1, 16)]
            else:
                blob[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            limit = min(limit, len(blob))
        (directory / file).write_bytes(bytes(blob))
        try:
            load_under("x", directory, root, base)
        except LoraAdapterError:
            pass
        (directory / file).write_bytes(originals[file])


def test_nan_weights_are_refused(base: Path, good: Path, root: Path) -> None:
    directory = under_root(good, root)
    header, data = read_safetensors(directory / "adapter_model.safetensors")
    begin = header["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]["data_offsets"][0]
    data = data[:begin] + struct.pack("<f", float("nan")) + data[begin + 4:]
    write_safetensors(directory / "adapter_model.safetensors", header, data)
    refused_under(directory, root, base, "NaN or infinite values in layer 1 v_proj's lora_B")


# --- The worker's LoadLora: the files are read and checked on the handler thread; the model thread (and,
# with tensor parallelism, every rank) only packs checked tensors, and a failure anywhere is a typed answer ---

class Aborted(Exception):
    pass


class FakeContext:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


class FakeGroup:
    """Rank 0 of a two-rank group whose other rank is `follower_fails` (what it adds to the failure count)."""

    enabled, rank, size = True, 0, 2

    def __init__(self, follower_fails: int) -> None:
        self.follower_fails, self.sent, self.sums = follower_fails, [], []

    def broadcast_command(self, command):
        self.sent.append(command)
        return command

    def sum_over_ranks(self, value: int, device: torch.device) -> int:
        self.sums.append(value)
        return value + self.follower_fails


def worker(base: Path, root: Path | None, tp=None) -> WorkerServicer:
    config, _ = load_checkpoint(base)
    loras = LoraSlots(config, 2, 64, torch.device("cpu"), torch.float32, TensorParallel(),
                      lora_root=None if root is None else str(root))
    return WorkerServicer(SimpleNamespace(loras=loras, tp=tp or TensorParallel(), device=torch.device("cpu")))


def load_on_worker(servicer: WorkerServicer, path: Path | str, before_model_thread=lambda: None):
    """LoadLora on a handler thread; the test's thread plays the model thread. (answer or Aborted, context)."""
    context, answer = FakeContext(), {}

    def handler() -> None:
        try:
            answer["value"] = servicer.LoadLora(worker_pb2.LoadLoraRequest(name="a", path=str(path), slot=1), context)
        except Aborted as exc:
            answer["value"] = exc

    thread = threading.Thread(target=handler)
    thread.start()
    while thread.is_alive() and servicer.steps.empty():
        thread.join(timeout=0.01)
    if not servicer.steps.empty():
        before_model_thread()
        servicer._run(servicer.steps.get_nowait())
    thread.join(timeout=60)
    return answer["value"], context


def test_a_bad_adapter_is_refused_on_the_handler_thread_and_never_queued(base: Path, good: Path, root: Path,
                                                                       tmp_path: Path) -> None:
    servicer = worker(base, root)
    outside = shutil.copytree(good, tmp_path / "outside")
    directory = under_root(good, root)
    (directory / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": {}}')
    for path, words in ((outside, "not under the worker's lora_root"), (directory, "lora_alpha = {}")):
        answer, context = load_on_worker(servicer, path)
        assert isinstance(answer, Aborted) and context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert words in context.details
        assert servicer.steps.empty() and not servicer.runner.loras.has(1)
    answer, context = load_on_worker(worker(base, None), good)
    assert isinstance(answer, Aborted) and "set lora_root" in context.details


def test_the_model_thread_only_packs_what_the_handler_read_and_checked(base: Path, good: Path, root: Path) -> None:
    servicer = worker(base, root)
    directory = under_root(good, root)
    # The files are gone by the time the model thread runs the load: it reads none.
    answer, _ = load_on_worker(servicer, directory, before_model_thread=lambda: shutil.rmtree(directory))
    assert (answer.name, answer.slot, answer.rank, answer.path) == ("a", 1, 8, str(directory))
    assert servicer.runner.loras.has(1) and servicer.runner.loras.loaded() == [answer]


def test_a_rank_that_cannot_load_leaves_every_rank_as_it_was_with_a_typed_answer(
        base: Path, good: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail(f"the worker would have exited ({code})"))
    directory = under_root(good, root)
    group = FakeGroup(follower_fails=1)
    servicer = worker(base, root, group)
    answer, context = load_on_worker(servicer, directory)
    assert isinstance(answer, Aborted) and context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 other tensor-parallel rank(s)" in context.details and "lora_root" in context.details
    assert [kind for kind, _ in group.sent] == ["lora_load"] and group.sums == [0]
    assert not servicer.runner.loras.has(1)
    # Rank 0 failing untyped while packing (a bug, memory): still a typed answer after the collective.
    monkeypatch.setattr(servicer.runner.loras, "stage", lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    answer, context = load_on_worker(servicer, directory)
    assert context.code == grpc.StatusCode.INTERNAL and "log has the details" in context.details
    assert "boom" not in context.details  # an untyped error's text stays in the log
    assert group.sums == [0, 1] and not servicer.runner.loras.has(1)


def test_a_follower_rank_reads_and_checks_for_itself_and_joins_the_count(base: Path, good: Path,
                                                                       root: Path, tmp_path: Path) -> None:
    group = FakeGroup(follower_fails=0)  # here the "other" rank is rank 0, which succeeded
    follower = worker(base, root, group).runner
    outside = shutil.copytree(good, tmp_path / "outside")
    with pytest.raises(LoraAdapterError, match="not under the worker's lora_root"):
        load_lora_on_rank(follower, worker_pb2.LoadLoraRequest(name="a", path=str(outside), slot=1), None)
    assert group.sums == [1] and not follower.loras.has(1)
    info = load_lora_on_rank(follower, worker_pb2.LoadLoraRequest(name="a", path=str(under_root(good, root)),
                                                                  slot=1), None)
    assert info.rank == 8 and group.sums == [1, 0] and follower.loras.has(1)


def test_no_tensor_byte_is_read_before_the_header_is_checked(base: Path, good: Path, root: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that does not fit the served model: only the 8-byte length and the header itself are read."""
    from gpu_worker.lora import adapter_files

    directory = under_root(good, root)
    header, data = read_safetensors(directory / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"  # a target the served model has, at rank 9
    write_safetensors(directory / "adapter_model.safetensors", {**header, key: {**header[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], "shape": [9, 64]}}, data)
    reads: list[list[int]] = []  # per file opened, the bytes each read returned (-1: a readinto)
    opened = os.fdopen

    class Counting:
        def __init__(self, stream) -> None:
            self.stream, self.reads = stream, []
            reads.append(self.reads)

        def __getattr__(self, name: str):
            return getattr(self.stream, name)

        def __enter__(self):
            return self

        def __exit__(self, *_) -> None:
            self.stream.close()

        def read(self, size: int) -> bytes:
            got = self.stream.read(size)
            self.reads.append(len(got))
            return got

        def readinto(self, buffer) -> int:
            self.reads.append(-1)
            return self.stream.readinto(buffer)

    monkeypatch.setattr(adapter_files.os, "fdopen", lambda fd, mode: Counting(opened(fd, mode)))
    refused_under(directory, root, base, "lora_A (9, 64)")
    header_bytes = struct.unpack("<Q", (directory / "adapter_model.safetensors").read_bytes()[:8])[0]
    assert reads[1] == [8, header_bytes]  # reads[0]: adapter_config.json
