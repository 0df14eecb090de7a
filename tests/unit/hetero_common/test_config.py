"""The config object: defaults, precedence (CLI > env > file > preset > defaults), validation."""

from __future__ import annotations

import argparse
import json

import pytest

from hetero_common.config import PRESETS, Config
from hetero_infer.config_sources import add_config_arguments, config_from_args, config_keys, load_config
from hetero_common.errors import ConfigError


def test_seed_defaults() -> None:
    c = load_config(env={})
    # Unset, the pool's cap and the step batch are the device's (hetero_common/device_defaults.py): on a CPU the
    # seed's 1024 and 32, on CUDA what memory, max_num_seqs and the token budget allow.
    assert (c.block_size, c.max_num_blocks, c.max_batch_size, c.max_num_seqs) == (16, None, None, 256)
    assert (c.max_model_len, c.max_total_tokens, c.memory_threshold, c.max_retry_attempts) == (2048, 4096, 0.9, 2)
    assert c.serving.backend.kind == "scheduler"


def test_precedence_cli_over_env_over_file(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size": 8, "max_batch_size": 4, "max_num_seqs": 7, "serving": {"port": 6000}}))
    env = {"HETERO_BLOCK_SIZE": "32", "HETERO_MAX_BLOCKS": "77", "HETERO_MEMORY_THRESHOLD": "0.5",
           "HETERO_SERVING_PORT": "7000"}
    c = load_config(path, env, {"block_size": "64"})
    assert c.block_size == 64  # CLI beats env and file
    assert c.max_num_blocks == 77  # the seed's short env name
    assert c.memory_threshold == 0.5
    assert c.serving.port == 7000  # env beats file
    assert c.max_batch_size == 4 and c.max_num_seqs == 7  # file beats defaults


def test_presets_apply_under_explicit_values(tmp_path) -> None:
    for name, values in PRESETS.items():
        c = load_config(env={}, preset=name)
        assert all(getattr(c, k) == v for k, v in values.items())
    c = load_config(env={"HETERO_PRESET": "long_context", "HETERO_MAX_BATCH_SIZE": "3"})
    assert c.max_model_len == 8192 and c.max_batch_size == 3


@pytest.mark.parametrize("overrides, key", [
    ({"block_size": 0}, "block_size"), ({"block_size": 129}, "block_size"),
    ({"max_num_blocks": 0}, "max_num_blocks"), ({"memory_threshold": 1.5}, "memory_threshold"),
    ({"max_model_len": 8, "block_size": 16}, "max_model_len"), ({"serving.port": 70000}, "serving.port"),
    ({"serving.backend.kind": "magic"}, "serving.backend.kind"),
    ({"serving.backend.kind": "command_bridge"}, "serving.backend.command.program"),
    ({"enable_chunked_prefill": "false", "max_total_tokens": 100}, "max_total_tokens"),
])
def test_validation_names_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(env={}, cli_overrides=overrides)


def test_bad_types_and_unknown_keys(tmp_path) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        load_config(env={"HETERO_BLOCK_SIZE": "sixteen"})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"blok_size": 8}))
    with pytest.raises(ConfigError, match="blok_size"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json", env={})


def test_seed_backend_spelling_and_command(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"serving": {"backend": {"kind": "command_bridge", "command": {
        "program": "/bin/sh", "args": ["-c", "printf 'bridge:%s' \"$HETERO_PROMPT\""]}}}}))
    backend = load_config(path, env={}).serving.backend
    assert backend.kind == "command_bridge" and backend.command.program == "/bin/sh"
    assert backend.command.args[0] == "-c"
    assert load_config(env={"HETERO_SERVING_BACKEND_KIND": "local_engine"}).serving.backend.kind == "scheduler"


def test_cli_flags_cover_every_key() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--block-size", "8", "--serving-port", "6001", "--memory-threshold", "0.7"])
    c = config_from_args(args, env={})
    assert (c.block_size, c.serving.port, c.memory_threshold) == (8, 6001, 0.7)
    flags = {k.flag for k in config_keys()}
    assert {"--max-num-blocks", "--serving-model-name", "--tokenizer-path"} <= flags


def test_round_trip_through_file(tmp_path) -> None:
    c = load_config(env={}, cli_overrides={"block_size": 4, "serving.model_name": "x"})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c.to_dict()))
    assert load_config(path, env={}) == c
    assert Config().validate() == Config()


def test_resilience_keys_are_validated() -> None:
    c = load_config(env={}, cli_overrides={"data_parallel_size": 2, "worker_address": "127.0.0.1:7000"})
    assert c.replica_addresses() == ["127.0.0.1:7000", "127.0.0.1:7001"]
    c = load_config(env={}, cli_overrides={"data_parallel_size": 2, "worker_addresses": "h:1, h:2"})
    assert c.replica_addresses() == ["h:1", "h:2"]
    for overrides, key in (({"data_parallel_size": 2, "worker_addresses": "h:1"}, "worker_addresses"),
                           ({"routing_policy": "random"}, "routing_policy"),
                           ({"max_queued_requests": 0}, "max_queued_requests"),
                           ({"serving.backend.fallback": "command_bridge"}, "serving.backend.command.program"),
                           ({"serving.backend.fallback": "maybe"}, "serving.backend.fallback")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(env={}, cli_overrides=overrides)


@pytest.mark.parametrize("overrides,key", [
    ({"prefix_caching_eviction_policy": "fifo"}, "prefix_caching_eviction_policy"),
    ({"max_prefill_chunk_tokens": -1}, "max_prefill_chunk_tokens"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"kv_cache_management_mode": "swap"}, "kv_cache_management_mode"),
])
def test_kv_cache_keys_are_validated(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        Config(**overrides).validate()


def test_offload_is_the_seed_name_of_swap_preemption() -> None:
    assert Config(preemption_mode="offload").validate().preemption_mode == "swap"
    assert load_config(None, {"HETERO_PREFIX_CACHING_EVICTION_POLICY": "ref_zero"}, {}).prefix_caching_eviction_policy == "ref_zero"



def test_request_limit_keys_come_from_env_and_flags_and_are_validated() -> None:
    c = load_config(env={"HETERO_SERVING_MAX_REQUEST_BYTES": "2048", "HETERO_SERVING_METRICS_REQUIRE_KEY": "true"},
                    cli_overrides={"serving.http_header_timeout_s": "2.5", "serving.max_connections": "7"})
    assert (c.serving.max_request_bytes, c.serving.metrics_require_key) == (2048, True)
    assert (c.serving.http_header_timeout_s, c.serving.max_connections) == (2.5, 7)
    assert Config().serving.max_request_bytes == 4 * 1024 * 1024 and Config().serving.metrics_require_key is False
    flags = {k.flag for k in config_keys()}
    assert {"--serving-max-request-bytes", "--serving-http-body-timeout-s", "--serving-grpc-idle-timeout-s"} <= flags
    for overrides, key in (({"serving.max_request_bytes": 100}, "serving.max_request_bytes"),
                           ({"serving.max_request_bytes": 2 << 30}, "serving.max_request_bytes"),
                           ({"serving.max_connections": -1}, "serving.max_connections"),
                           ({"serving.grpc_max_concurrent_streams": 0}, "serving.grpc_max_concurrent_streams"),
                           ({"serving.http_keep_alive_timeout_s": 0}, "serving.http_keep_alive_timeout_s"),
                           ({"serving.http_header_timeout_s": -1}, "serving.http_header_timeout_s"),
                           ({"serving.http_body_timeout_s": 0}, "serving.http_body_timeout_s"),
                           ({"serving.grpc_idle_timeout_s": 0}, "serving.grpc_idle_timeout_s")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(env={}, cli_overrides=overrides)
