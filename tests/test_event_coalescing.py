"""The gateway merges a sample's token events that queued up behind each other (the client reading
slower than the engine steps) into one message: tokens, timestamps and logprobs in order, the last
event's position and finish reason; never across samples, past a sample's last event, or into an
error; an item it took off the queue but could not merge comes next."""

from __future__ import annotations

import asyncio

import pytest

from gateway.scheduler_backend import _EventState, _next_event
from gateway.scheduler_events import SubmitEnded
from hetero.v1 import common_pb2, scheduler_pb2


def ev(position: int, token: int, index: int = 0, finish: int = 0, **kw) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", position=position, token_ids=[token], index=index,
                                    token_timestamps=[float(position)], logprobs=[-0.5 * token],
                                    finish_reason=finish, **kw)


def drain(items: list[object], samples: int = 1) -> list[scheduler_pb2.TokenEvent]:
    async def run() -> list[scheduler_pb2.TokenEvent]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        state = _EventState(set(range(samples)))
        out = []
        while state.open_samples:
            out.append(await _next_event(queue, state))
        return out

    return asyncio.run(run())


def test_queued_events_of_one_sample_go_out_as_one() -> None:
    (merged,) = drain([ev(0, 5, cached_prompt_tokens=4), ev(1, 6), ev(2, 7, finish=common_pb2.FINISH_REASON_LENGTH)])
    assert list(merged.token_ids) == [5, 6, 7] and list(merged.token_timestamps) == [0.0, 1.0, 2.0]
    assert list(merged.logprobs) == [-2.5, -3.0, -3.5] and merged.position == 2
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.cached_prompt_tokens == 4


def test_no_merge_across_samples_or_past_an_end_or_into_an_error() -> None:
    events = drain([ev(0, 5, index=0), ev(1, 6, index=1), ev(2, 7, index=1, finish=common_pb2.FINISH_REASON_STOP),
                    ev(3, 8, index=0), ev(4, 9, index=0, finish=common_pb2.FINISH_REASON_ERROR, error="boom")], samples=2)
    assert [list(e.token_ids) for e in events] == [[5], [6, 7], [8], [9]]
    assert events[-1].error == "boom"


def test_a_replayed_event_is_skipped_and_a_held_item_comes_next() -> None:
    events = drain([ev(0, 5), ev(0, 5), ev(1, 6), SubmitEnded(None), ev(2, 7), ev(3, 8, finish=common_pb2.FINISH_REASON_STOP)])
    assert [list(e.token_ids) for e in events] == [[5, 6], [7, 8]]


def test_the_submit_calls_error_taken_while_merging_is_raised_next() -> None:
    with pytest.raises(RuntimeError, match="gone"):
        drain([ev(0, 5), ev(1, 6), RuntimeError("gone")])
