"""Writing a step's decisions into its StepPlan as diffs against what the worker already holds:
a sequence is sent whole once, afterwards only its appended blocks and table edits.

The scheduler decides; this module writes: `PlanWriter` holds one step's entries as protobuf wire
bytes (`write_entry`) and its swap-ins, `WorkerOutbox` what the worker is to be told with a later
plan (block copies, swap-outs, sequences to forget) and which sequences it holds, and `PlanWriter.plan`
puts them together. A sequence's new blocks and table edits come from the KV manager as a value
(`KVBlocks`, `KVCacheManager.take_unsent`): this module never reads a block table.
"""

from __future__ import annotations

from hetero.v1 import worker_pb2
from scheduler_svc.kv.kv_cache_manager import NOTHING_NEW, CopiedBlock, KVBlocks, KVCacheManager
from scheduler_svc.sequence import Sequence


def plan_needs_worker(plan: worker_pb2.StepPlan) -> bool:
    """Whether a plan must reach the worker: tokens to compute, or blocks to swap or copy.

    A swap-in alone must be sent even when nothing is computed this step: the sequence's
    block table and K/V arrive with it."""
    return bool(plan.scheduled or plan.swap_out or plan.swap_in or plan.block_copies)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


SMALL_VARINTS = [_varint(v) for v in range(1 << 14)]  # every value below 16,384: one or two bytes


def varint(value: int) -> bytes:
    """Protobuf's base-128 encoding of a non-negative integer."""
    return SMALL_VARINTS[value] if value < 16384 else _varint(value)


def _tag(message: type, field: str, wire_type: int) -> bytes:
    """A field's key as protobuf writes it (field number << 3 | wire type), read from the descriptor
    so that a renumbered field in worker.proto changes the bytes too."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


_VARINT, _LENGTH_DELIMITED = 0, 2
_SEQ_ID = _tag(worker_pb2.ScheduledSequence, "seq_id", _VARINT)
_NUM_TOKENS = _tag(worker_pb2.ScheduledSequence, "num_tokens", _VARINT)
_SAMPLE_TRUE = _tag(worker_pb2.ScheduledSequence, "sample", _VARINT) + b"\x01"
_NUM_CACHED = _tag(worker_pb2.ScheduledSequence, "num_cached_tokens", _VARINT)
_NEW_BLOCK_IDS = _tag(worker_pb2.ScheduledSequence, "new_block_ids", _LENGTH_DELIMITED)
_DRAFT_TOKEN_IDS = _tag(worker_pb2.ScheduledSequence, "draft_token_ids", _LENGTH_DELIMITED)
_DRAFT_MODEL_TOKENS = _tag(worker_pb2.ScheduledSequence, "num_draft_model_tokens", _VARINT)
_PLAN_SCHEDULED = _tag(worker_pb2.StepPlan, "scheduled", _LENGTH_DELIMITED)
_PLAN_NEW_SEQUENCE = _tag(worker_pb2.StepPlan, "new_sequences", _LENGTH_DELIMITED)
_NEW_SEQ_ID = _tag(worker_pb2.NewSequence, "seq_id", _VARINT)
_NEW_TOKEN_IDS = _tag(worker_pb2.NewSequence, "token_ids", _LENGTH_DELIMITED)  # packed fixed32
_NEW_PARAMS = _tag(worker_pb2.NewSequence, "params", _LENGTH_DELIMITED)
_NEW_NUM_GENERATED = _tag(worker_pb2.NewSequence, "num_generated", _VARINT)
_NEW_LORA_SLOT = _tag(worker_pb2.NewSequence, "lora_slot", _VARINT)
_NEW_POOLING = _tag(worker_pb2.NewSequence, "pooling", _VARINT)
_DECODE_TAG_BYTES = len(_SEQ_ID) + len(_NUM_TOKENS) + len(_SAMPLE_TRUE) + len(_NUM_CACHED)


def add_scheduled(plan: worker_pb2.StepPlan, scheduled: list[tuple[Sequence, int]], kv_cache: KVCacheManager,
                  outbox: WorkerOutbox, arm: bool = True) -> None:
    """Schedule each sequence's next `num_tokens` uncomputed tokens; their blocks are already allocated.

    The `scheduled` entries are one per sequence per step, so they are written as wire bytes and
    parsed into the plan in one call: building a message per entry cost several times more. The
    bytes are protobuf's own encoding (an empty proto3 field is left out, as protobuf does), and the
    plan holds the parsed messages, so its serialization is the one of entries built field by field.
    With `arm`, each entry arms its sequence's decode fast path (`write_entry`)."""
    parts: list[bytes] = []
    for seq, num_tokens in scheduled:
        write_entry(parts, seq, num_tokens, kv_cache, outbox, arm=arm)
    plan.MergeFromString(b"".join(parts))


def write_entry(parts: list[bytes], seq: Sequence, num_tokens: int, kv_cache: KVCacheManager, outbox: WorkerOutbox,
                drafts: list[int] | tuple[()] = (), model_drafts: int = 0, arm: bool = True) -> None:
    """One `scheduled` entry's wire bytes, appended to `parts` (for a sequence not on the worker yet, its
    `new_sequences` entry first: the plan parses them into their own field, in order).

    Every entry but one with copy-on-write table edits is written by hand (`_entry_bytes`). Then the
    sequence's next decode is prepared (with `arm`): `seq.fast_until` is the token count up to which
    that decode's entry is the plain one with its bytes before num_cached_tokens the same (`seq.decode_head`,
    kept on the sequence) and needs no block: no new block, no copy-on-write (blocks it holds alone),
    num_cached_tokens' varint as long. The scheduler writes such a decode's entry itself
    (`decode_head` + num_cached_tokens' varint) without coming here; anything that changes the sequence's
    blocks or worker state sets `fast_until` to 0 (`disarm`: a free, a fork, a swap-out, `WorkerOutbox.release`).
    `drafts`: speculative proposals after the sequence's last token (speculation.py), computed with it;
    `model_drafts`: how many the worker's draft model is to propose instead. A `speculative` sequence's decodes
    are never armed (its next one may carry drafts)."""
    token_ids = seq.token_ids
    if seq.seq_id not in outbox.on_worker:
        parts += new_sequence_bytes(seq)
        outbox.on_worker.add(seq.seq_id)
    num_computed = seq.num_computed
    sample = num_computed + num_tokens == len(token_ids)
    computed = num_computed + num_tokens  # the next decode's num_cached_tokens
    blocks, room = kv_cache.take_unsent(seq, computed if arm and sample and not seq.info.speculative else -1)
    if blocks is not NOTHING_NEW or not sample or not num_computed or drafts or model_drafts:
        body = _entry_bytes(seq, num_tokens, sample, blocks, drafts, model_drafts)
        parts += (_PLAN_SCHEDULED, varint(len(body)), body)
    else:  # a decode in blocks the worker has: seq_id, num_tokens, sample = true, num_cached_tokens
        parts += (decode_head(seq.seq_id, num_computed, num_tokens), varint(num_computed))
    if room:
        seq.fast_until = min(room, 128 if computed < 128 else 16384 if computed < 16384 else 0)
        seq.decode_head = decode_head(seq.seq_id, computed, 1)
    else:
        seq.fast_until = 0


def new_sequence_bytes(seq: Sequence) -> tuple[bytes, ...]:
    """The plan's `new_sequences` entry for `seq` as wire bytes: its ids packed as fixed32 (`Sequence.packed`:
    protobuf's conversion of a list into a repeated field cost four times as much, for every prompt
    admitted, and the prefix-cache hashes packed most of them already), then its parameters and how many
    tokens it generated before."""
    info, num_tokens = seq.info, len(seq.token_ids)
    num_generated, ids = num_tokens - info.prompt_len, seq.packed(num_tokens)[:4 * num_tokens]
    params = info.params.SerializeToString()
    body = [_NEW_SEQ_ID, varint(seq.seq_id)] if seq.seq_id else []  # in number order, empty fields left out
    body += (_NEW_TOKEN_IDS, varint(len(ids)), ids, _NEW_PARAMS, varint(len(params)), params)  # params: always set
    if num_generated:
        body += (_NEW_NUM_GENERATED, varint(num_generated))
    if info.lora_slot:
        body += (_NEW_LORA_SLOT, varint(info.lora_slot))
    if info.pooling:
        body += (_NEW_POOLING, varint(info.pooling))
    entry = b"".join(body)
    return _PLAN_NEW_SEQUENCE, varint(len(entry)), entry


def decode_head(seq_id: int, num_computed: int, num_tokens: int) -> bytes:
    """A decode entry's bytes up to its num_cached_tokens value: the plan's field key, the entry's length,
    seq_id, num_tokens, sample = true and num_cached_tokens' key (the length counts its varint)."""
    a, b = varint(seq_id), varint(num_tokens)
    size = len(a) + len(b) + len(varint(num_computed)) + _DECODE_TAG_BYTES
    return b"".join((_PLAN_SCHEDULED, varint(size), _SEQ_ID, a, _NUM_TOKENS, b, _SAMPLE_TRUE, _NUM_CACHED))


def disarm(seq: Sequence) -> None:
    """The sequence's blocks or worker state changed: its next decode takes the general path (`write_entry`)."""
    seq.fast_until = 0


def _entry_bytes(seq: Sequence, num_tokens: int, sample: bool, blocks: KVBlocks, drafts: list[int] | tuple[()] = (),
                 model_drafts: int = 0) -> bytes:
    """Any other entry: new blocks, a prompt chunk, table edits (copy-on-write). Written by hand too, but
    for table edits (rare: a message); a message per entry cost three times as much (one per admission
    and per block a sequence fills)."""
    new_blocks = blocks.new_block_ids
    if blocks.edits:
        entry = worker_pb2.ScheduledSequence(seq_id=seq.seq_id, num_tokens=num_tokens + len(drafts) + model_drafts,
                                             sample=sample, new_block_ids=new_blocks, num_cached_tokens=seq.num_computed,
                                             draft_token_ids=drafts, num_draft_model_tokens=model_drafts)
        for index, block_id in blocks.edits:
            entry.block_table_edits.add(index=index, block_id=block_id)
        return entry.SerializeToString()
    parts = [_SEQ_ID, varint(seq.seq_id)] if seq.seq_id else []  # in number order, empty fields left out (as protobuf)
    if num_tokens:
        parts += (_NUM_TOKENS, varint(num_tokens + len(drafts) + model_drafts))
    if new_blocks:
        packed = b"".join([varint(b) for b in new_blocks])
        parts += (_NEW_BLOCK_IDS, varint(len(packed)), packed)
    if sample:
        parts.append(_SAMPLE_TRUE)
    if seq.num_computed:
        parts += (_NUM_CACHED, varint(seq.num_computed))
    if drafts:
        packed = b"".join([varint(t) for t in drafts])
        parts += (_DRAFT_TOKEN_IDS, varint(len(packed)), packed)
    if model_drafts:
        parts += (_DRAFT_MODEL_TOKENS, varint(model_drafts))
    return b"".join(parts)


class WorkerOutbox:
    """What the worker is to be told besides a step's entries, kept until a plan carries it: swap-outs
    (blocks to copy to host memory) and block copies (copy-on-write) go with the next plan; the seq ids
    it should forget wait for a plan that must reach the worker anyway (`plan_needs_worker`). And which
    sequences the worker holds (sent whole once: `write_entry`)."""

    __slots__ = ("swap_outs", "block_copies", "released", "on_worker")

    def __init__(self) -> None:
        self.swap_outs: list[worker_pb2.SwapBlocks] = []
        self.block_copies: list[worker_pb2.BlockCopy] = []
        self.released: list[int] = []
        self.on_worker: set[int] = set()  # seq ids the worker holds the state of

    def holds(self, seq: Sequence) -> bool:
        """Whether the worker holds the sequence's state (it was sent whole and not released since)."""
        return seq.seq_id in self.on_worker

    def release(self, seq: Sequence) -> None:
        """The worker forgets the sequence with the next plan it is sent."""
        if seq.seq_id in self.on_worker:
            self.on_worker.discard(seq.seq_id)
            self.released.append(seq.seq_id)
            seq.fast_until = 0  # disarm(seq), inlined: once per sequence that ends

    def swap_out(self, seq_id: int, block_ids: list[int]) -> None:
        """The worker copies these blocks of the sequence to host memory before the next step."""
        self.swap_outs.append(worker_pb2.SwapBlocks(seq_id=seq_id, block_ids=block_ids))

    def cancel_swap_out(self, seq_id: int) -> None:
        """A swap-out not sent yet is moot (the sequence ended), and the worker forgets released ids
        before swapping."""
        self.swap_outs = [sw for sw in self.swap_outs if sw.seq_id != seq_id]

    def copy_blocks(self, copies: list[CopiedBlock]) -> None:
        """The worker copies each shared block before the step writes into it (where its table holds the old
        block, the KV manager keeps the edit for the sequence's next entry: `take_unsent`)."""
        for c in copies:
            self.block_copies.append(worker_pb2.BlockCopy(src=c.src, dst=c.dst))

    def send_moves(self, plan: worker_pb2.StepPlan) -> None:
        """The swap-outs and block copies go with this plan (the worker does them before its step)."""
        if self.swap_outs:  # each touch of a plan's repeated field costs: the empty ones are left alone
            plan.swap_out.extend(self.swap_outs)
            self.swap_outs = []
        if self.block_copies:
            plan.block_copies.extend(self.block_copies)
            self.block_copies = []

    def send_released(self, plan: worker_pb2.StepPlan) -> None:
        """The released ids go with this plan if it goes to the worker (`plan_needs_worker`, its other
        fields written): a plan with nothing to compute or move is not sent, and they wait for the next."""
        if self.released and plan_needs_worker(plan):
            plan.released_seq_ids.extend(self.released)
            self.released.clear()

    @property
    def copies_pending(self) -> bool:
        return bool(self.block_copies)

    def clear(self) -> None:
        """The worker's state is void: nothing to tell it, and it holds nothing."""
        for pending in (self.swap_outs, self.block_copies, self.released):
            pending.clear()
        self.on_worker.clear()


class PlanWriter:
    """One step's plan while the scheduler decides it: the scheduled entries as wire bytes in plan order
    (`write_entry`, into `parts`), and the swap-ins. `plan` parses them into the StepPlan."""

    __slots__ = ("kv_cache", "outbox", "parts", "swap_ins", "drafted")

    def __init__(self, kv_cache: KVCacheManager, outbox: WorkerOutbox) -> None:
        self.kv_cache, self.outbox = kv_cache, outbox
        # The entries' bytes. A decode on its fast path (`write_entry`: `Sequence.fast_until`) is written
        # into it by the scheduler itself, as its `decode_head` and num_cached_tokens' varint (SMALL_VARINTS).
        self.parts: list[bytes] = []
        self.swap_ins: list[worker_pb2.SwapBlocks] = []
        self.drafted: list[Sequence] = []  # the sequences whose entries carry speculative drafts

    def entry(self, seq: Sequence, num_tokens: int, drafts: list[int] | tuple[()] = (), model_drafts: int = 0) -> None:
        """Schedule the sequence's next `num_tokens` tokens (their blocks allocated; and `drafts` after them, or
        `model_drafts` from the worker's draft model), arming its fast path."""
        write_entry(self.parts, seq, num_tokens, self.kv_cache, self.outbox, drafts, model_drafts)
        if drafts or model_drafts:
            self.drafted.append(seq)

    def swap_in(self, seq: Sequence, block_ids: list[int]) -> None:
        """The sequence's K/V comes back from host memory into its new block table (`KVCacheManager.swap_in`)."""
        self.swap_ins.append(worker_pb2.SwapBlocks(seq_id=seq.seq_id, block_ids=block_ids))

    def plan(self, step_id: int) -> worker_pb2.StepPlan:
        """The step's plan, with what the outbox has for the worker."""
        plan = worker_pb2.StepPlan(step_id=step_id)
        if self.swap_ins:  # (each touch of a plan's repeated field costs: the empty ones are left alone)
            plan.swap_in.extend(self.swap_ins)
        self.outbox.send_moves(plan)
        if self.parts:
            plan.MergeFromString(b"".join(self.parts))
        self.outbox.send_released(plan)
        return plan
