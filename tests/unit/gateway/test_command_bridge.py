"""The command bridge: a real program per request, prompt and params through the environment."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from gateway.backends.command_bridge import CommandBridge, TextChunk
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


def test_non_zero_exit_reports_the_stderr_tail(tmp_path: Path) -> None:
    source = "import sys\nsys.stderr.write('noise\\n' * 1000 + 'model file is corrupt')\nsys.exit(3)\n"
    with pytest.raises(CommandBridgeError, match="(?s)code 3.*model file is corrupt") as info:
        run(bridge(tmp_path, source))
    assert len(info.value.message) < 2500  # only the tail


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
    with pytest.raises(ValidationError, match="NUL"):
        run(bridge(tmp_path, ECHO_ENV), "a\x00b")
