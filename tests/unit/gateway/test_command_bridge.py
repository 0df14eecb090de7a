"""The command bridge: a real program per request, prompt and params through the environment."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.backends import command_bridge
from gateway.backends.bridge_requests import MAX_ENV_STRING_BYTES
from gateway.backends.command_bridge import STDERR_TAIL_BYTES, CommandBridge, TextChunk
from hetero.v1 import common_pb2
from hetero_common.config import BackendConfig, CommandConfig
from hetero_common.errors import CommandBridgeError, CommandBridgeNotFoundError, DeadlineExceededError, ValidationError
from hetero_common.sampling import resolve

ECHO_ENV = """
import json, os, sys
keys = ["HETERO_PROMPT", "HETERO_MAX_TOKENS", "HETERO_TEMPERATURE", "HETERO_TOP_P", "HETERO_TOP_K", "HETERO_SEED",
        "HETERO_STOP", "HETERO_REQUEST_ID", "HETERO_MODEL", "HETERO_SAMPLE_INDEX"]
sys.stdout.write(json.dumps({k: os.environ.get(k) for k in keys}, ensure_ascii=False))
"""


def bridge(tmp_path: Path, source: str, **kw) -> CommandBridge:
    script = tmp_path / "bridge.py"
    script.write_text(source)
    return CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig(sys.executable, [str(script)]), **kw))


def run(b: CommandBridge, prompt: str = "hi", **params) -> list[TextChunk]:
    async def collect() -> list[TextChunk]:
        return [c async for c in b.stream("rid-1", prompt, resolve(common_pb2.SamplingParams(**params)), "tiny")]
    return asyncio.run(collect())


def test_prompt_and_params_pass_intact_through_the_environment(tmp_path: Path) -> None:
    prompt = 'She said "hi" & left; $(rm -rf /) `x`\n\tnext line — café 東京 🙂 \\n \'single\''
    chunks = run(bridge(tmp_path, ECHO_ENV), prompt, max_tokens=7, temperature=0.0, top_p=0.5, top_k=3, seed=11,
                 stop=["END", "x\ny"])
    assert chunks[-1].finished and not chunks[-1].truncated
    env = json.loads("".join(c.text for c in chunks))
    assert env["HETERO_PROMPT"] == prompt
    assert (env["HETERO_MAX_TOKENS"], env["HETERO_TOP_K"], env["HETERO_SEED"]) == ("7", "3", "11")
    assert float(env["HETERO_TEMPERATURE"]) == 0.0 and float(env["HETERO_TOP_P"]) == 0.5
    assert json.loads(env["HETERO_STOP"]) == ["END", "x\ny"]
    assert (env["HETERO_REQUEST_ID"], env["HETERO_MODEL"], env["HETERO_SAMPLE_INDEX"]) == ("rid-1", "tiny", "0")


def test_stdout_streams_in_pieces(tmp_path: Path) -> None:
    """The program writes the rest only once the test has been given its first word (or after a
    30 s hang guard): a bridge that buffered to the end would hand it all over at once."""
    seen = tmp_path / "first-word-seen"
    source = ("import os, sys, time\nsys.stdout.write('one '); sys.stdout.flush()\n"
              "deadline = time.monotonic() + 30\n"
              f"while not os.path.exists({str(seen)!r}) and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
              "sys.stdout.write('two three'); sys.stdout.flush()\n")

    async def collect() -> list[TextChunk]:
        chunks = []
        async for chunk in bridge(tmp_path, source).stream("rid-1", "hi", resolve(common_pb2.SamplingParams()), "tiny"):
            chunks.append(chunk)
            if chunk.text:
                seen.touch()
        return chunks

    chunks = asyncio.run(collect())
    assert "".join(c.text for c in chunks) == "one two three"
    assert [c.text for c in chunks if c.text][0] == "one "  # streamed, not buffered to the end


def test_missing_program_is_a_clear_error(tmp_path: Path) -> None:
    b = CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig(str(tmp_path / "no-such-program"))))
    with pytest.raises(CommandBridgeNotFoundError, match="serving.backend.command.program"):
        run(b)


def test_non_zero_exit_reports_its_status_and_logs_the_stderr_tail(tmp_path: Path) -> None:
    """The client learns the program failed and how; its stderr (paths, secrets, a model's
    internals) goes only to the gateway's log, and only its tail."""
    source = "import sys\nsys.stderr.write('noise\\n' * 10000 + 'model file is corrupt')\nsys.exit(3)\n"
    with capture_logs() as logs, pytest.raises(CommandBridgeError, match="code 3") as info:
        run(bridge(tmp_path, source))
    assert "corrupt" not in info.value.message and "noise" not in info.value.message
    failed = [entry for entry in logs if entry["event"] == "bridge program failed"]
    assert failed and failed[0]["exit_code"] == 3 and failed[0]["stderr_tail"].endswith("model file is corrupt")
    assert len(failed[0]["stderr_tail"]) <= STDERR_TAIL_BYTES  # a bounded tail, not the whole 60 KB


def test_timeout_kills_the_program(tmp_path: Path) -> None:
    marker = tmp_path / "still-running"
    source = f"import time, pathlib\nprint('partial', flush=True)\ntime.sleep(30)\npathlib.Path({str(marker)!r}).write_text('x')\n"
    with pytest.raises(DeadlineExceededError, match="command_timeout_s"):
        run(bridge(tmp_path, source, command_timeout_s=1.0))
    assert not marker.exists()


def test_output_over_the_cap_is_cut_and_the_program_killed(tmp_path: Path) -> None:
    source = "import sys\nwhile True:\n    sys.stdout.write('é' * 1000); sys.stdout.flush()\n"
    chunks = run(bridge(tmp_path, source, command_max_output_bytes=5001))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finished and chunks[-1].truncated
    assert len(text.encode()) <= 5001 and text.startswith("éé") and "\ufffd" not in text


def test_nul_in_prompt_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="NUL") as info:
        run(bridge(tmp_path, ECHO_ENV), "a\x00b")
    assert info.value.param == "prompt"


# --- The program's process group: nothing it starts outlives the request -------------------------

# A program that starts a grandchild (`sleep 1000`, holding stdout open), says so once its pid is
# written, and waits for it.
GRANDCHILD = "sleep 1000 & echo $! > {pidfile}; echo started; wait"


def sh_bridge(script: str, **kw) -> CommandBridge:
    return CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig("/bin/sh", ["-c", script]), **kw))


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """The process has ended: no /proc entry, or a zombie (killed, waiting for its reaper)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    """Where a program writes its grandchild's pid; a grandchild left over is killed, whatever the test said."""
    path = tmp_path / "grandchild.pid"
    yield path
    if path.exists() and path.read_text().strip():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def grandchild_pid(path: Path, wait_s: float = 10.0) -> int:
    deadline = time.monotonic() + wait_s
    while not (path.exists() and path.read_text().strip().isdigit()):
        assert time.monotonic() < deadline, "the program never started its grandchild"
        time.sleep(0.01)
    return int(path.read_text())


def test_timeout_kills_the_whole_group(pidfile: Path) -> None:
    with pytest.raises(DeadlineExceededError, match="command_timeout_s"):
        run(sh_bridge(GRANDCHILD.format(pidfile=pidfile), command_timeout_s=1.0))
    assert gone(grandchild_pid(pidfile)), "the grandchild outlived the timeout"
    assert not command_bridge._RUNNING_GROUPS


def test_abort_kills_the_whole_group(pidfile: Path) -> None:
    b = sh_bridge(GRANDCHILD.format(pidfile=pidfile))

    async def abort_midway() -> list[TextChunk]:
        task = asyncio.create_task(collect(b))
        await asyncio.to_thread(grandchild_pid, pidfile)
        assert b.abort("rid-1")
        return await asyncio.wait_for(task, 10)

    chunks = asyncio.run(abort_midway())
    assert chunks[-1].finished and chunks[-1].aborted
    assert gone(grandchild_pid(pidfile)), "the grandchild outlived the abort"


def test_abort_across_tenants_matches_the_client_id(pidfile: Path) -> None:
    """The registry is keyed by scoped id: a plain abort needs it; an admin's (`any_tenant`) matches the client's id."""
    b = sh_bridge(GRANDCHILD.format(pidfile=pidfile))
    scoped = "key-0123456789ab/rid-1"

    async def abort_midway() -> list[TextChunk]:
        task = asyncio.create_task(collect(b, scoped))
        await asyncio.to_thread(grandchild_pid, pidfile)
        assert not b.abort("rid-1") and not b.abort("key-ffffffffffff/rid-1")  # another tenant's id is not it
        assert b.abort("rid-1", any_tenant=True)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(abort_midway())[-1].aborted
    assert gone(grandchild_pid(pidfile))


def test_client_going_away_kills_the_whole_group(pidfile: Path) -> None:
    b = sh_bridge(GRANDCHILD.format(pidfile=pidfile))

    async def first_chunk_only() -> str:
        async with aclosing(b.stream("rid-1", "hi", resolve(common_pb2.SamplingParams()), "tiny")) as chunks:
            async for chunk in chunks:
                return chunk.text
        return ""

    assert asyncio.run(first_chunk_only()).startswith("started")
    assert gone(grandchild_pid(pidfile)), "the grandchild outlived its client"
    assert not b.processes and not command_bridge._RUNNING_GROUPS


def test_gateway_stop_kills_the_whole_group(pidfile: Path) -> None:
    b = sh_bridge(GRANDCHILD.format(pidfile=pidfile))

    async def stop_midway() -> None:
        task = asyncio.create_task(collect(b))
        await asyncio.to_thread(grandchild_pid, pidfile)
        b.kill_all()
        with pytest.raises(CommandBridgeError, match="signal 9"):
            await asyncio.wait_for(task, 10)

    asyncio.run(stop_midway())
    assert gone(grandchild_pid(pidfile))


def test_what_a_program_leaves_running_ends_with_it(pidfile: Path) -> None:
    """A program that exits at once, leaving a background process (its stdio closed): that one is killed too."""
    script = f"(sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}); echo done"
    chunks = run(sh_bridge(script))
    assert "".join(c.text for c in chunks) == "done\n" and chunks[-1].finished
    assert gone(grandchild_pid(pidfile))


def test_a_process_that_leaves_the_group_cannot_hang_the_stream(pidfile: Path) -> None:
    """`setsid` takes a grandchild out of the group, out of the kill's reach, holding stdout open: the
    drain after the kill waits a bounded time, then gives up; the stream still ends (an unbounded drain
    would wait for the grandchild's `sleep 1000`, and the test's timeout would end it)."""
    try:
        with pytest.raises(DeadlineExceededError):
            run(sh_bridge(f"setsid sleep 1000 & echo $! > {pidfile}; exec sleep 1000", command_timeout_s=1.0))
        assert not command_bridge._RUNNING_GROUPS
    finally:
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(grandchild_pid(pidfile), signal.SIGKILL)  # out of the group's reach: the test ends it


async def collect(b: CommandBridge, request_id: str = "rid-1", prompt: str = "hi") -> list[TextChunk]:
    return [c async for c in b.stream(request_id, prompt, resolve(common_pb2.SamplingParams()), "tiny")]


# --- The environment: an allow-list, and values that fit ---------------------------------------

REQUEST_VARIABLES = {"HETERO_PROMPT", "HETERO_REQUEST_ID", "HETERO_MODEL", "HETERO_MAX_TOKENS", "HETERO_TEMPERATURE",
                     "HETERO_TOP_P", "HETERO_TOP_K", "HETERO_STOP", "HETERO_SAMPLE_INDEX"}


def program_environment(monkeypatch: pytest.MonkeyPatch, **kw) -> dict[str, str]:
    """What `env` (the program) sees, with secrets set in the gateway's own environment."""
    monkeypatch.setenv("HETERO_SERVING_API_KEYS", "sk-gateway-secret")
    monkeypatch.setenv("GATEWAY_DB_PASSWORD", "hunter2")
    monkeypatch.setenv("BRIDGE_VISIBLE", "yes")
    env_program = shutil.which("env") or "/usr/bin/env"
    chunks = run(CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig(env_program), **kw)))
    text = "".join(c.text for c in chunks)
    assert "sk-gateway-secret" not in text and "hunter2" not in text
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_the_program_inherits_only_the_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    env = program_environment(monkeypatch)
    assert set(env) - REQUEST_VARIABLES <= {"PATH", "LANG", "LC_ALL", "TZ"}  # the default command_env
    assert set(env) >= REQUEST_VARIABLES and env["PATH"] == os.environ["PATH"]


def test_command_env_names_what_is_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    env = program_environment(monkeypatch, command_env=["BRIDGE_VISIBLE"])
    assert set(env) - REQUEST_VARIABLES == {"BRIDGE_VISIBLE"} and env["BRIDGE_VISIBLE"] == "yes"


def marker_bridge(tmp_path: Path) -> tuple[CommandBridge, Path]:
    """A program that leaves a file behind when it runs: a refusal must come before any process."""
    marker = tmp_path / "ran"
    return bridge(tmp_path, f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"), marker


@pytest.mark.parametrize("stop", [[f"s{i}" for i in range(17)], ["x" * 3000] * 16, ["y" * 200_000]],
                         ids=["17 strings", "48 KB in 16", "one of 200 KB"])
def test_stop_strings_over_the_caps_are_refused_before_any_process(tmp_path: Path, stop: list[str]) -> None:
    b, marker = marker_bridge(tmp_path)
    with pytest.raises(ValidationError, match="stop") as info:
        run(b, stop=stop)
    assert info.value.param == "stop" and not marker.exists()


def test_a_prompt_up_to_one_variable_s_cap_passes_intact(tmp_path: Path) -> None:
    fits = "a" * (MAX_ENV_STRING_BYTES - len("HETERO_PROMPT=") - 1)
    source = "import os, sys\nsys.stdout.write(str(len(os.environ['HETERO_PROMPT'])))\n"
    assert "".join(c.text for c in run(bridge(tmp_path, source), fits)) == str(len(fits))


@pytest.mark.parametrize("prompt", ["a" * MAX_ENV_STRING_BYTES, "é" * (MAX_ENV_STRING_BYTES // 2), "b" * 1_000_000],
                         ids=["one byte over", "over in UTF-8", "1 MB"])
def test_a_prompt_over_one_variable_s_cap_is_refused_before_any_process(tmp_path: Path, prompt: str) -> None:
    b, marker = marker_bridge(tmp_path)
    with pytest.raises(ValidationError, match="HETERO_PROMPT") as info:
        run(b, prompt)
    assert info.value.param == "prompt" and not marker.exists()


def test_nul_in_request_id_is_refused(tmp_path: Path) -> None:
    b, marker = marker_bridge(tmp_path)
    with pytest.raises(ValidationError, match="NUL") as info:
        asyncio.run(collect(b, "rid\x00x"))
    assert info.value.param == "request_id" and not marker.exists()


@pytest.mark.parametrize(("args", "says"), [(["a\x00b"], "serving.backend.command"), (["x" * 200_000], "E2BIG")],
                         ids=["NUL in an argument", "an argument over exec's cap"])
def test_exec_refusing_the_program_is_a_bridge_error(args: list[str], says: str) -> None:
    b = CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig(sys.executable, args)))
    with pytest.raises(CommandBridgeError, match=says):
        run(b)
    assert not b.processes and not command_bridge._RUNNING_GROUPS


# --- At most command_max_concurrent programs at once -----------------------------------------------

WAIT_FOR_GO = """
import os, pathlib, sys, time
runs = pathlib.Path(sys.argv[1])
(runs / f"run-{os.getpid()}").touch()
deadline = time.monotonic() + 30  # a hang guard
while not (runs / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.stdout.write("done")
"""


def waiting_bridge(tmp_path: Path, **kw) -> tuple[CommandBridge, Path]:
    runs = tmp_path / "runs"
    runs.mkdir()
    script = tmp_path / "wait_for_go.py"
    script.write_text(WAIT_FOR_GO)
    config = CommandConfig(sys.executable, [str(script), str(runs)])
    return CommandBridge(BackendConfig(kind="command_bridge", command=config, **kw)), runs


def started(runs: Path) -> int:
    return len(list(runs.glob("run-*")))


def test_requests_beyond_command_max_concurrent_wait_without_a_process(tmp_path: Path) -> None:
    b, runs = waiting_bridge(tmp_path, command_max_concurrent=2)

    async def five_at_once() -> list[list[TextChunk]]:
        tasks = [asyncio.create_task(collect(b, f"rid-{i}")) for i in range(5)]
        deadline = time.monotonic() + 20
        while started(runs) < 2:
            assert time.monotonic() < deadline, "the first two programs never started"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # time for a third to start, were the cap not kept
        assert started(runs) == 2 and len(b.processes) == 2
        (runs / "go").touch()
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    answers = asyncio.run(five_at_once())
    assert ["".join(c.text for c in chunks) for chunks in answers] == ["done"] * 5 and started(runs) == 5


def test_the_wait_for_a_slot_ends_at_the_request_s_deadline(tmp_path: Path) -> None:
    b, runs = waiting_bridge(tmp_path, command_max_concurrent=1)

    async def second_waits_too_long() -> None:
        first = asyncio.create_task(collect(b, "rid-1"))
        while started(runs) < 1:
            await asyncio.sleep(0.01)
        sampling = resolve(common_pb2.SamplingParams())
        with pytest.raises(DeadlineExceededError, match="command_max_concurrent"):
            async for _ in b.stream("rid-2", "hi", sampling, "tiny", wait_s=0.3):
                pass
        assert started(runs) == 1  # the refused one never started a program
        (runs / "go").touch()
        await asyncio.wait_for(first, 30)

    asyncio.run(second_waits_too_long())
