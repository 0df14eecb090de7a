"""The scheduler's Follow stream (one message per engine step for every request that names it),
on the real three-process stack: a step's events travel together, a Submit that re-attaches on
another Follow stream replays the events so far there (with their positions), and cancelling a
Submit that forwards its events still aborts its request."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import grpc
import pytest

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_infer.bench.harness import Stack, free_port, run_stack, wait_for_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scheduler_address() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, scheduler_address: str):
    with run_stack(tiny_llama_dir, "--scheduler-address", scheduler_address, "--log-level", "warning") as s:
        yield s


def submit(request_id: str, follower_id: str, max_tokens: int, first: int = 9) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=[first, 8, 7, 6], follower_id=follower_id,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


class Follow:
    """A Follow call read on a thread: its batches as they come."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.follower_id = uuid.uuid4().hex
        self.call = stub.Follow(scheduler_pb2.FollowRequest(follower_id=self.follower_id))
        self.batches: list[list[scheduler_pb2.TokenEvent]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(list(batch.events))
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def events(self, request_id: str) -> list[scheduler_pb2.TokenEvent]:
        return [e for b in self.batches for e in b if e.request_id == request_id]

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=10)


def test_a_steps_events_for_several_requests_come_in_one_message(stack: Stack, scheduler_address: str) -> None:
    with grpc.insecure_channel(scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        follow = Follow(stub)
        calls = [stub.Submit(submit(f"batch-{i}", follow.follower_id, 24, first=10 + i)) for i in range(4)]
        for call in calls:
            assert list(call) == []  # the events went to the Follow stream; the call ended OK with its request
        follow.close()
        direct = [[t for e in stub.Submit(submit(f"direct-{i}", "", 24, first=10 + i)) for t in e.token_ids]
                  for i in range(4)]
    for i in range(4):
        events = follow.events(f"batch-{i}")
        assert [e.position for e in events] == list(range(len(events)))
        assert [t for e in events for t in e.token_ids] == direct[i]  # the same tokens as on the request's own stream
        assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert max(len({e.request_id for e in b}) for b in follow.batches) == 4  # decode steps: one message for all four
    assert len(follow.batches) < 4 * 24
    assert wait_for_idle(stack).used_blocks == 0


def test_resubmitting_on_another_follow_stream_replays_then_follows(stack: Stack, scheduler_address: str) -> None:
    with grpc.insecure_channel(scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        first, second = Follow(stub), Follow(stub)
        first_call = stub.Submit(submit("reattach", first.follower_id, 60))
        while not first.events("reattach"):
            threading.Event().wait(0.01)
        # A retry after the gateway's connection broke: a new Follow stream, the same request.
        second_call = stub.Submit(submit("reattach", second.follower_id, 60))
        assert list(second_call) == [] and list(first_call) == []
        assert stub.GetStats(scheduler_pb2.GetStatsRequest()).pool.num_running == 0
        first.close()
        second.close()
    replayed = second.events("reattach")
    assert [e.position for e in replayed] == list(range(len(replayed)))  # from the start, in order, once each
    tokens = [t for e in replayed for t in e.token_ids]
    assert len(tokens) == 60 and tokens == [t for e in first.events("reattach") for t in e.token_ids]
    assert wait_for_idle(stack).used_blocks == 0


def test_cancelling_a_forwarding_submit_aborts_its_request(stack: Stack, scheduler_address: str) -> None:
    with grpc.insecure_channel(scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        follow = Follow(stub)
        call = stub.Submit(submit("cancelled", follow.follower_id, 400))
        while not follow.events("cancelled"):
            threading.Event().wait(0.01)
        call.cancel()
        assert wait_for_idle(stack).used_blocks == 0  # the blocks are freed although the Follow stream lives on
        last = follow.events("cancelled")[-1]
        follow.close()
    assert last.finish_reason in (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_UNSPECIFIED)
