"""tp_init_method: where tensor-parallel ranks on different hosts meet (validated, from every
source, ahead of serve's rendezvous file only when serve passes none), and the interface gloo is
given for a tcp:// rendezvous. Ranks really meeting across namespaces: tests/multihost/test_multihost.py."""

from __future__ import annotations

import os

import pytest

from gpu_worker.parallel.tp_rendezvous import init_method, interface_towards, prepare_gloo
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.cli import main
from hetero_infer.config_sources import load_config


def test_tp_init_method_is_validated_and_read_from_every_source() -> None:
    assert Config().validate().tp_init_method == ""
    assert load_config(env={"HETERO_TP_INIT_METHOD": "tcp://10.0.0.5:29500"}).tp_init_method == "tcp://10.0.0.5:29500"
    assert load_config(env={}, cli_overrides={"tp_init_method": "env://"}).tp_init_method == "env://"
    for bad in ("10.0.0.5:29500", "tcp://10.0.0.5", "tcp://:29500", "tcp://h:99999", "nccl://h:1"):
        with pytest.raises(ConfigError, match="'tp_init_method'"):
            Config(tp_init_method=bad).validate()


def test_serve_file_first_then_the_configured_method() -> None:
    assert init_method("/tmp/rdv", "tcp://h:1") == "file:///tmp/rdv"
    assert init_method(None, "tcp://h:1") == "tcp://h:1"
    assert init_method(None, "") is None


def test_serve_refuses_one_rendezvous_address_for_several_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--data-parallel-size", "2", "--tp-init-method", "tcp://127.0.0.1:29500",
                 "--tensor-parallel-size", "2", "--log-level", "error"])
    assert code == 1 and "tp_init_method" in capsys.readouterr().err


def test_gloo_gets_the_interface_that_routes_to_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_towards("127.0.0.1") == "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    prepare_gloo("tcp://127.0.0.1:29500")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    prepare_gloo("tcp://127.0.0.1:29500")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
