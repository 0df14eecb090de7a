"""Bounded queue, deadlines, idempotent Submit, SIGTERM drain and no orphans after a SIGKILL of
`serve`, on the real three-process stack."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_infer.bench.harness import REPO_ROOT, Stack, free_port, pool, run_stack, service_stats, wait_for_idle
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow
LONG = 2000  # tokens: several seconds of work through the stack (400 took ~1 s: too close to a 1 s deadline)


def request(max_tokens: int, request_id: str = "", first: int = 5) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=request_id,
                                         prompt_token_ids=inference_pb2.TokenIds(ids=[first, 6, 7, 8]),
                                         params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))


@pytest.fixture(scope="module")
def scheduler_address() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def stack(long_context_llama_dir: Path, scheduler_address: str):
    # Two sequences run at once; two more may wait; everything beyond is refused.
    with run_stack(long_context_llama_dir, "--block-size", "5", "--max-model-len", "2048", "--max-num-seqs", "2",
                   "--max-queued-requests", "2", "--scheduler-address", scheduler_address,
                   "--log-level", "warning") as s:
        yield s


def occupy(stack: Stack, count: int) -> list:
    """Start `count` long streams and wait until each produced a token (so they hold their slot)."""
    calls = [stack.inference.Generate(request(LONG, f"busy-{i}-{time.monotonic_ns()}")) for i in range(count)]
    for call in calls:
        next(call)
    return calls


def test_queue_full_is_resource_exhausted(stack: Stack) -> None:
    running = occupy(stack, 2)
    waiting = [stack.inference.Generate(request(4, f"wait-{i}")) for i in range(2)]
    deadline = time.monotonic() + 20
    while pool(stack).num_waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool(stack).num_waiting == 2
    with pytest.raises(grpc.RpcError) as info:
        stack.inference.Complete(request(4, "one-too-many"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests" in info.value.details()
    assert service_stats(stack).num_rejected_queue_full >= 1
    for call in running:
        call.cancel()
    for call in waiting:  # the queued ones are served once the slots free up
        assert sum(len(m.token_ids) for m in call) == 4
    assert wait_for_idle(stack).used_blocks == 0


def test_deadline_while_queued_and_while_running(stack: Stack) -> None:
    before = service_stats(stack).num_deadline_exceeded
    running = occupy(stack, 2)
    # Queued behind the two long ones: its deadline passes before it is admitted.
    with pytest.raises(grpc.RpcError) as info:
        list(stack.inference.Generate(request(4, "queued-deadline"), timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for call in running:
        call.cancel()
    wait_for_idle(stack)
    # Running: a generation far longer than its deadline.
    with pytest.raises(grpc.RpcError) as info:
        list(stack.inference.Generate(request(LONG, "running-deadline"), timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    p, s = wait_for_idle(stack), service_stats(stack)
    assert p.used_blocks == 0
    assert s.num_deadline_exceeded >= before + 2  # the scheduler dropped both with its own finish reason


def test_resubmitting_a_request_id_in_flight_reattaches_without_a_second_generation(stack: Stack,
                                                                                    scheduler_address: str) -> None:
    submit = scheduler_pb2.SubmitRequest(request_id="same-id", prompt_token_ids=[9, 8, 7, 6],
                                         params=common_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        first = scheduler.Submit(submit)
        head = next(first)  # generating
        second = scheduler.Submit(submit)  # e.g. a retry after the first call's connection broke
        second_events = []
        second_events.append(next(second))
        assert scheduler.GetStats(scheduler_pb2.GetStatsRequest()).pool.num_running == 1  # one generation
        first_ids = list(head.token_ids) + [t for e in first for t in e.token_ids]
        second_ids = [t for e in second_events for t in e.token_ids] + [t for e in second for t in e.token_ids]
    assert len(first_ids) == 40 and second_ids == first_ids  # the second call replays, then follows
    assert wait_for_idle(stack).used_blocks == 0


def test_sigterm_drains_in_flight_requests(tiny_llama_dir: Path) -> None:
    # A grace far above the stream's needs: a loaded CI machine must not turn a drain into a cut.
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512", "--log-level", "warning",
                   "--drain-grace-s", "120") as stack:
        call = stack.inference.Generate(request(120, "draining"))
        tokens = list(next(call).token_ids)
        stack.process.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(stack.channel)

        def not_serving() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return True

        wait_until(not_serving, what="the gateway reporting NOT_SERVING (it drains) after serve's SIGTERM")
        late = itertools.count()

        def refused() -> bool:
            """Whether a new call is refused; it must be UNAVAILABLE. Its server stops taking calls right
            after health says NOT_SERVING: one sent in between is still served."""
            try:
                stack.inference.Complete(request(2, f"too-late-{next(late)}"), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return True
            return False

        wait_until(refused, interval=0.05, what="a new call refused UNAVAILABLE while the gateway drains")
        last = None
        started = time.monotonic()
        try:
            for msg in call:
                tokens.extend(msg.token_ids)
                last = msg
        except grpc.RpcError as exc:
            raise AssertionError(f"stream broken after {time.monotonic() - started:.1f} s, {len(tokens)} tokens") from exc
        assert len(tokens) == 120 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert stack.process.wait(60) == 0


def test_sigterm_drains_http_and_grpc_streams_at_once(tiny_llama_dir: Path) -> None:
    """The gateway drains both protocols together: an SSE stream and a gRPC stream in flight both finish."""
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512", "--log-level", "warning",
                   "--drain-grace-s", "120") as stack:
        call = stack.inference.Generate(request(200, "grpc-draining"))
        tokens = list(next(call).token_ids)
        body = {"prompt": "water", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=120) as sse:
            lines = sse.iter_lines()
            first = next(line for line in lines if line)
            stack.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        tokens += [t for msg in call for t in msg.token_ids]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(rest).replace(" ", "")
        assert len(tokens) == 200
        assert stack.process.wait(60) == 0


def test_killing_serve_leaves_no_orphans(tiny_llama_dir: Path) -> None:
    """SIGKILL gives `serve` no chance to stop its children: each asked the kernel to be told."""
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512", "--log-level", "warning") as stack:
        children = psutil.Process(stack.process.pid).children()
        assert len(children) == 3  # worker, scheduler, gateway
        names = {p.pid: p.cmdline()[p.cmdline().index("hetero_infer.cli") + 1] for p in children}
        stack.process.kill()
        stack.process.wait(10)
        _, alive = psutil.wait_procs(children, timeout=30)
        for p in alive:  # not left running after the test
            p.kill()
        assert not alive, f"orphans: {[(p.pid, names[p.pid]) for p in alive]}"


# A child of `serve` whose drain never ends: it ignores the SIGTERM that its parent's death sends.
STUCK_CHILD = """
import signal, sys, time
from hetero_infer.parent_death import die_with_parent
assert die_with_parent(int(sys.argv[1]), exit_within_s=1.0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""
# Plays `serve`: starts the child (its stderr to the file named), says its pid, waits to be killed.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stderr=open(sys.argv[2], "wb"))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_an_orphan_whose_drain_hangs_exits_anyway(tmp_path: Path) -> None:
    """With `serve` gone nobody kills a service stuck in its drain: it exits by itself, and its
    watchdog is what ends it (its last words say so: exit_within_s after the parent died)."""
    said = tmp_path / "child.stderr"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, STUCK_CHILD, str(said)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline() == "ready\n"
        parent.kill()
        parent.wait(10)
        try:
            child.wait(60)  # a hang guard: the watchdog waits 1 s
        except psutil.TimeoutExpired:
            child.kill()
            raise AssertionError("the orphan did not exit within 60 s")
        assert "did not stop within 1 s; exiting now" in said.read_text()
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_same_request_id_with_another_prompt_is_refused(stack: Stack, scheduler_address: str) -> None:
    params = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        first = scheduler.Submit(scheduler_pb2.SubmitRequest(request_id="taken", prompt_token_ids=[1, 2, 3], params=params))
        next(first)
        with pytest.raises(grpc.RpcError) as info:
            next(scheduler.Submit(scheduler_pb2.SubmitRequest(request_id="taken", prompt_token_ids=[4, 5], params=params)))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()
    assert wait_for_idle(stack).used_blocks == 0
