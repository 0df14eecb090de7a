"""The gateway merges a sample's token events that queued up behind each other (the client reading
slower than the engine steps) into one message: tokens, timestamps and logprobs in order, the last
event's position and finish reason; never across samples, past a sample's last event, or into an
error; an item it took off the queue but could not merge comes next. With serving.stream_interval N,
it also waits for a sample's later events until a message holds N tokens (the first goes alone), but
never past the sample's end or an error; each sample's tokens are grouped apart, so interleaved samples
(n > 1) neither wait for nor split each other's messages."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.backends.scheduler_backend import _EventState, _next_event
from gateway.backends.scheduler_events import SubmitEnded
from gateway.text.text_stream import TextStream
from hetero.v1 import common_pb2, scheduler_pb2
from hetero_common.config import Config, ServingConfig
from hetero_common.errors import ConfigError
from hetero_common.sampling import resolve
from hetero_common.tokenizer import load_tokenizer


def ev(position: int, token: int, index: int = 0, finish: int = 0, **kw) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", position=position, token_ids=[token], index=index,
                                    token_timestamps=[float(position)], logprobs=[-0.5 * token],
                                    finish_reason=finish, **kw)


def drain(items: list[object], samples: int = 1, interval: int = 1, trickle: bool = False,
          out: list[scheduler_pb2.TokenEvent] | None = None) -> list[scheduler_pb2.TokenEvent]:
    """The messages `_next_event` makes of `items`: all queued at once, or (`trickle`) one per turn of
    the event loop, as a Follow stream delivers one step's events at a time. `out` collects them as
    they come (to read them when the drain raises)."""
    out = [] if out is None else out

    async def run() -> list[scheduler_pb2.TokenEvent]:
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def feed() -> None:
            for item in items:
                queue.put_nowait(item)
                await asyncio.sleep(0)

        if trickle:
            feeder = asyncio.create_task(feed())
        else:
            for item in items:
                queue.put_nowait(item)
        state = _EventState(set(range(samples)))
        while state.open_samples:
            out.append(await _next_event(queue, state, interval))
        if trickle:
            await feeder
        return out

    return asyncio.run(run())


def test_queued_events_of_one_sample_go_out_as_one() -> None:
    (merged,) = drain([ev(0, 5, cached_prompt_tokens=4), ev(1, 6), ev(2, 7, finish=common_pb2.FINISH_REASON_LENGTH)])
    assert list(merged.token_ids) == [5, 6, 7] and list(merged.token_timestamps) == [0.0, 1.0, 2.0]
    assert list(merged.logprobs) == [-2.5, -3.0, -3.5] and merged.position == 2
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.cached_prompt_tokens == 4


def test_merged_events_sum_their_speculative_draft_counts() -> None:
    (merged,) = drain([ev(0, 5), ev(1, 6, draft_tokens=3, accepted_draft_tokens=1),
                       ev(2, 7, draft_tokens=2, accepted_draft_tokens=2, finish=common_pb2.FINISH_REASON_LENGTH)])
    assert (merged.draft_tokens, merged.accepted_draft_tokens) == (5, 3)


def test_no_merge_across_samples_or_past_an_end_or_into_an_error() -> None:
    events = drain([ev(0, 5, index=0), ev(1, 6, index=1), ev(2, 7, index=1, finish=common_pb2.FINISH_REASON_STOP),
                    ev(3, 8, index=0), ev(4, 9, index=0, finish=common_pb2.FINISH_REASON_ERROR, error="boom")], samples=2)
    assert [list(e.token_ids) for e in events] == [[5], [6, 7], [8], [9]]
    assert events[-1].error == "boom"


def test_a_replayed_event_is_skipped_and_an_ok_submit_end_splits_nothing() -> None:
    # The Submit call may end before the request's last events arrive on the Follow stream.
    events = drain([ev(0, 5), ev(0, 5), ev(1, 6), SubmitEnded(None), ev(2, 7), ev(3, 8, finish=common_pb2.FINISH_REASON_STOP)])
    assert [list(e.token_ids) for e in events] == [[5, 6, 7, 8]]
    events = drain([ev(0, 5), ev(1, 6), SubmitEnded(None), ev(2, 7, finish=common_pb2.FINISH_REASON_STOP)],
                   interval=3, trickle=True)
    assert [list(e.token_ids) for e in events] == [[5], [6, 7]]


def test_the_submit_calls_error_taken_while_merging_is_raised_next() -> None:
    with pytest.raises(RuntimeError, match="gone"):
        drain([ev(0, 5), ev(1, 6), RuntimeError("gone")])


def test_stream_interval_sends_the_first_token_alone_then_groups_of_n() -> None:
    items = [ev(i, 10 + i, finish=common_pb2.FINISH_REASON_LENGTH if i == 7 else 0) for i in range(8)]
    events = drain(items, interval=3, trickle=True)
    assert [list(e.token_ids) for e in events] == [[10], [11, 12, 13], [14, 15, 16], [17]]
    assert [e.position for e in events] == [0, 3, 6, 7] and events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert list(events[1].token_timestamps) == [1.0, 2.0, 3.0] and list(events[1].logprobs) == [-5.5, -6.0, -6.5]
    # interval 1 (the default): each event as it comes
    assert [list(e.token_ids) for e in drain(items, trickle=True)] == [[t] for t in range(10, 18)]


def test_stream_interval_waits_for_no_other_sample() -> None:
    stop = common_pb2.FINISH_REASON_STOP
    items = [ev(0, 5, index=0), ev(1, 6, index=1), ev(2, 7, index=0), ev(3, 8, index=1, finish=stop),
             ev(4, 9, index=0), ev(5, 10, index=0, finish=stop)]
    events = drain(items, samples=2, interval=4, trickle=True)
    # sample 1's end goes out as it comes, while sample 0's 7 waits in its own group
    assert [(e.index, list(e.token_ids)) for e in events] == [(0, [5]), (1, [6]), (1, [8]), (0, [7, 9, 10])]


def test_stream_interval_groups_each_of_interleaved_samples_apart() -> None:
    """n = 2 samples step together, so their events alternate: grouping per sample still makes messages of N."""
    length = common_pb2.FINISH_REASON_LENGTH
    items = [ev(2 * i + s, 100 * s + i, index=s, finish=length if i == 6 else 0) for i in range(7) for s in (0, 1)]
    events = drain(items, samples=2, interval=3, trickle=True)
    assert [(e.index, list(e.token_ids)) for e in events] == [
        (0, [0]), (1, [100]), (0, [1, 2, 3]), (1, [101, 102, 103]), (0, [4, 5, 6]), (1, [104, 105, 106])]
    assert [list(e.token_timestamps) for e in events[2:4]] == [[2.0, 4.0, 6.0], [3.0, 5.0, 7.0]]
    assert events[-1].finish_reason == length and events[-1].position == 13
    # everything queued at once makes the same messages
    assert [list(e.token_ids) for e in drain(items, samples=2, interval=3)] == [list(e.token_ids) for e in events]


def test_stream_interval_sends_every_samples_buffered_tokens_before_an_error() -> None:
    out: list[scheduler_pb2.TokenEvent] = []
    with pytest.raises(RuntimeError, match="gone"):
        drain([ev(0, 5, index=0), ev(1, 6, index=1), ev(2, 7, index=0), ev(3, 8, index=1), ev(4, 9, index=0),
               RuntimeError("gone")], samples=2, interval=8, trickle=True, out=out)
    assert [(e.index, list(e.token_ids)) for e in out] == [(0, [5]), (1, [6]), (0, [7, 9]), (1, [8])]
    # a sample's own error event goes out after its buffered tokens, as its last message
    events = drain([ev(0, 5), ev(1, 6), ev(2, 7, finish=common_pb2.FINISH_REASON_ERROR, error="boom")], interval=8,
                   trickle=True)
    assert [(list(e.token_ids), e.error) for e in events] == [([5], ""), ([6], ""), ([7], "boom")]


def test_stream_interval_hands_over_its_tokens_before_an_error() -> None:
    out: list[scheduler_pb2.TokenEvent] = []
    with pytest.raises(RuntimeError, match="gone"):
        drain([ev(0, 5), ev(1, 6), ev(2, 7), RuntimeError("gone")], interval=8, trickle=True, out=out)
    assert [list(e.token_ids) for e in out] == [[5], [6, 7]]


def test_a_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="serving.stream_interval"):
        Config(serving=ServingConfig(stream_interval=0)).validate()


def test_a_stop_string_inside_a_merged_message_says_which_token_completed_it(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    ids = tokenizer.encode(" The quick brown fox. The lazy dog.", add_special_tokens=False)
    prompt = tokenizer.encode("Paris", add_special_tokens=False)
    sampling = resolve(common_pb2.SamplingParams(stop=["fox"]))
    one_by_one = TextStream(tokenizer, prompt, sampling)
    texts, used = [], 0
    for used, token_id in enumerate(ids, 1):
        delta = one_by_one.push([token_id])
        texts.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped and used < len(ids)
    merged = TextStream(tokenizer, prompt, sampling).push_until_stop(ids)
    assert merged.stopped and merged.stop_string == "fox" and merged.used_tokens == used
    assert merged.text == "".join(texts) == " The quick brown "
    no_stop = TextStream(tokenizer, prompt, resolve(common_pb2.SamplingParams())).push_until_stop(ids)
    assert not no_stop.stopped and no_stop.used_tokens is None
