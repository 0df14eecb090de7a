"""`lora_modules` and the LoRA keys (hetero_common/lora_modules.py, issue 41): adapters in slot order, each
bad setting a ConfigError naming what to fix, an unknown adapter NOT_FOUND, a salt per adapter."""

from __future__ import annotations

import grpc
import pytest

from hetero_common.config import Config
from hetero_common.errors import ConfigError, ModelNotFoundError
from hetero_common.lora_modules import lora_cache_salt, lora_slot, parse_lora_modules


def test_adapters_come_in_slot_order() -> None:
    assert parse_lora_modules(" a=/x , b.v2=/y/z ,", 4) == [("a", "/x"), ("b.v2", "/y/z")]
    assert parse_lora_modules("", 4) == []
    assert lora_slot("a=/x,b=/y", 4, "b") == 2 and lora_slot("a=/x", 4, "") == 0


@pytest.mark.parametrize("value,words", [("a", "must be name=path"), ("=/x", "must be name=path"),
                                         ("-a=/x", "must start with a letter"), ("a=/x,a=/y", "given twice"),
                                         ("a=/1,b=/2,c=/3", r"more than max_loras \(2\)")])
def test_a_bad_entry_is_a_config_error_naming_it(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_lora_modules(value, 2)


def test_the_keys_are_validated_with_the_rest_of_the_config() -> None:
    with pytest.raises(ConfigError, match="max_lora_rank"):
        Config(max_lora_rank=0).validate()
    with pytest.raises(ConfigError, match="max_loras"):
        Config(max_loras=0).validate()
    with pytest.raises(ConfigError, match="'lora_modules'.*must be name=path"):
        Config(lora_modules="a").validate()


def test_an_unknown_adapter_is_not_found_and_each_adapter_has_its_own_salt() -> None:
    with pytest.raises(ModelNotFoundError, match="'c' is not loaded; loaded: a, b") as info:
        lora_slot("a=/x,b=/y", 4, "c")
    assert info.value.grpc_code == grpc.StatusCode.NOT_FOUND and info.value.http_status == 404
    salts = {lora_cache_salt("t", name) for name in ("", "a", "b")}
    assert len(salts) == 3 and lora_cache_salt("t", "") == "t"
