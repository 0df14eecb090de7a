"""The gateway's real HTTP app without a model: the command bridge backend runs `echo` (one real
process per request) and no scheduler answers, so routes, bodies and errors are tested in-process."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Iterator

from fastapi.testclient import TestClient

from gateway.auth import ApiKeys
from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.generation import Generation
from gateway.openai.app import HttpApi
from hetero.v1 import scheduler_pb2
from hetero_common.config import BackendConfig, CommandConfig, Config
from hetero_common.errors import UnavailableError
from hetero_common.tokenizer import TextTokenizer


@contextmanager
def bridge_http_client(tokenizer: TextTokenizer, max_model_len: int) -> Iterator[TestClient]:
    backend = BackendConfig(kind="command_bridge", command=CommandConfig(shutil.which("echo") or "/bin/echo", ["ok"]))
    config = Config(max_model_len=max_model_len)
    config.serving.backend = backend
    generation = Generation(config, tokenizer, CommandBridgeBackend(CommandBridge(backend), tokenizer, "tiny"))

    async def no_scheduler() -> scheduler_pb2.SchedulerStats:
        raise UnavailableError("no scheduler in this test")

    with TestClient(HttpApi(generation, ApiKeys([]), no_scheduler).app) as client:
        yield client
