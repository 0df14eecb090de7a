"""worker_dns without a stack: its config rules, the resolver's answers, the router growing."""

from __future__ import annotations

import asyncio

import pytest

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from scheduler_svc.replicas.discovery import format_address, resolve, split_host_port
from scheduler_svc.replicas.router import Router


def test_worker_dns_alone_means_no_static_replica() -> None:
    config = Config(worker_dns="workers.ns.svc.cluster.local:50053").validate()
    assert config.replica_addresses() == []
    # with a static list too, data_parallel_size need not count the replicas behind the name
    both = Config(worker_dns="workers:50053", worker_addresses="10.0.0.5:50053", data_parallel_size=3).validate()
    assert both.replica_addresses() == ["10.0.0.5:50053"]
    assert Config().validate().replica_addresses() == ["127.0.0.1:50053"]  # unchanged without it


@pytest.mark.parametrize("key, value", [("worker_dns", "workers"), ("worker_dns", "workers:http"),
                                        ("worker_dns", ":50053"), ("worker_dns", "workers:70000"),
                                        ("worker_dns_refresh_s", 0.0), ("internal_keepalive_s", -1.0)])
def test_bad_discovery_keys_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        Config(**{key: value}).validate()


def test_addresses_are_grpc_targets() -> None:
    assert split_host_port("[fd00::2]:50053") == ("fd00::2", 50053)
    assert format_address("fd00::2", 50053) == "[fd00::2]:50053"
    assert format_address("10.1.2.3", 1) == "10.1.2.3:1"


def test_resolve_returns_every_address_of_a_name_once() -> None:
    # "localhost" is in every /etc/hosts: the real resolver, no network needed.
    found = asyncio.run(resolve("localhost:50053"))
    assert found is not None and "127.0.0.1:50053" in found
    assert found == sorted(set(found))


def test_router_takes_replicas_that_join_later() -> None:
    router = Router("round_robin", 4, 0)
    assert [router.add_replica(), router.add_replica()] == [0, 1]
    picks = [router.choose([1, 2, 3], [0, 1], {}).replica for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    router.add_replica()
    assert sorted(router.choose([5], [0, 1, 2], {}).replica for _ in range(3)) == [0, 1, 2]
