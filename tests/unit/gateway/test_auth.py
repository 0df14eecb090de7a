"""Keys, roles and tenants (gateway/auth.py, hetero_common/tenancy.py): who a key is, which keys are
admins, start-up failing closed, and request ids scoped by tenant."""

from __future__ import annotations

import contextvars
from pathlib import Path

import pytest

from gateway.auth import UNAUTHENTICATED, ApiKeys, check_exposure, current_principal, require_admin
from gateway.limits.active_requests import ActiveRequests
from hetero_common.config import Config, ServingConfig
from hetero_common.errors import AuthenticationError, ConfigError, PermissionDeniedError
from hetero_common.tenancy import client_id, key_label, scoped_id


def test_a_key_is_its_tenant_and_admin_keys_are_admins() -> None:
    keys = ApiKeys(["sk-a", "sk-b"], ["sk-admin"])
    a, b, admin = keys.check("Bearer sk-a"), keys.check("bearer sk-b"), keys.check("Bearer sk-admin")
    assert (a.tenant, a.admin) == (key_label("sk-a"), False)
    assert b.tenant != a.tenant and not b.admin
    assert admin.admin and admin.tenant == key_label("sk-admin")
    assert ApiKeys(["same"], ["same"]).check("Bearer same").admin  # listed as both: the admin role
    for bad in (None, "", "Bearer", "Basic sk-a", "Bearer sk-c"):
        with pytest.raises(AuthenticationError):
            keys.check(bad)
    assert ApiKeys([]).check(None) is UNAUTHENTICATED


def test_labels_never_hold_the_key() -> None:
    label = key_label("sk-secret-value")
    assert label.startswith("key-") and len(label) == 16 and "secret" not in label


def test_require_admin_names_the_role() -> None:
    keys = ApiKeys(["sk-a"], ["sk-admin"])

    def as_callers() -> None:  # in a context of its own: the caller set here ends with it
        keys.enter("Bearer sk-admin")
        require_admin("loading a LoRA adapter")
        keys.enter("Bearer sk-a")
        assert current_principal().tenant == key_label("sk-a")
        with pytest.raises(PermissionDeniedError, match="loading a LoRA adapter needs an admin key"):
            require_admin("loading a LoRA adapter")

    contextvars.copy_context().run(as_callers)
    assert current_principal() is UNAUTHENTICATED


@pytest.mark.parametrize("content", ["", "\n  \n", "# a comment only\n"])
def test_a_keys_file_with_no_key_stops_start_up(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    for field in ("api_keys_file", "admin_api_keys_file"):
        config = Config(serving=ServingConfig(**{field: str(path)}))
        with pytest.raises(ConfigError, match=f"serving.{field}.*holds no key"):
            ApiKeys.from_config(config)


def test_no_keys_serves_only_on_loopback() -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_exposure(Config(serving=ServingConfig(host=host)), ApiKeys([]))
    for host in ("0.0.0.0", "::", "10.1.2.3", "gateway.example"):
        with pytest.raises(ConfigError, match="allow_unauthenticated"):
            check_exposure(Config(serving=ServingConfig(host=host)), ApiKeys([]))
        check_exposure(Config(serving=ServingConfig(host=host)), ApiKeys(["k"]))
        check_exposure(Config(serving=ServingConfig(host=host, allow_unauthenticated=True)), ApiKeys([]))


def test_request_ids_are_scoped_by_tenant() -> None:
    a, b = key_label("sk-a"), key_label("sk-b")
    assert scoped_id(a, "x") != scoped_id(b, "x") and scoped_id("", "x") == "x"
    for rid in ("x", "a/b", "key-123/x", ""):
        assert client_id(scoped_id(a, rid)) == rid
    assert client_id("plain/id") == "plain/id"  # unscoped ids (no keys) come back as they are
    active = ActiveRequests()
    active.register(scoped_id(a, "x"), [scoped_id(a, "x")])
    active.register(scoped_id(b, "x"), [scoped_id(b, "x")])
    assert active.lookup(scoped_id(a, "x")) == [scoped_id(a, "x")]
    assert active.lookup_any_tenant("x", client_id) == sorted([scoped_id(a, "x"), scoped_id(b, "x")])
    assert active.lookup_any_tenant("y", client_id) == []
