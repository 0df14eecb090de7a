"""docs/configuration.md documents exactly the config object's keys, and is what the generator
makes of the object today (so a new key, a changed default or a changed rule shows up there)."""

from __future__ import annotations

import json
import re

import pytest

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.config_doc import DOC_PATH, REGENERATE, render, sections, validation_rules
from hetero_infer.config_sources import _flatten_file, config_keys

KEY_ROW = re.compile(r"^\| `([a-z0-9_.]+)` \|", re.MULTILINE)


def keys_part(page: str) -> str:
    """The page's "## Keys" section: the presets table above it has rows per key too."""
    return page.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]


def test_the_page_lists_exactly_the_config_keys() -> None:
    assert DOC_PATH.is_file(), f"docs/configuration.md is missing: run {REGENERATE}"
    documented = KEY_ROW.findall(keys_part(DOC_PATH.read_text()))
    keys = [k.dotted for k in config_keys()]
    missing, unknown = sorted(set(keys) - set(documented)), sorted(set(documented) - set(keys))
    assert not missing and not unknown, (f"docs/configuration.md lacks {missing} and documents keys Config does "
                                         f"not have: {unknown}; run {REGENERATE}")
    assert len(documented) == len(set(documented)), "a key has two rows"


def test_the_page_is_generated_from_the_config_object() -> None:
    assert DOC_PATH.read_text() == render(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_every_row_names_the_key_its_env_variable_and_its_flag() -> None:
    page = keys_part(render())
    for key in config_keys():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key.dotted}` |"))
        assert f"`{key.env_name}`" in row and f"`{key.flag}`" in row, row


def test_every_key_has_a_meaning_and_its_validators_rules() -> None:
    rows = {row.key.dotted: row for section in sections() for row in section.rows}
    assert [k for k, row in rows.items() if not row.meaning] == []
    assert rows["block_size"].rules == ("must be in 1..128",)
    assert "must be ref_zero or lru" in rows["prefix_caching_eviction_policy"].rules
    # A rule on a part of a key is filed under the key, named by that part.
    assert "`program` is required when serving.backend.kind is command_bridge" in rows["serving.backend.command"].rules


def test_reading_the_rules_leaves_validation_as_it_was() -> None:
    assert set(validation_rules()) <= {k.dotted for k in config_keys()}
    with pytest.raises(ConfigError, match="'block_size'"):
        Config(block_size=0).validate()


def test_the_pages_json_examples_name_only_config_keys() -> None:
    keys = {k.path: k for k in config_keys()}
    examples = re.findall(r"```json\n(.*?)```", DOC_PATH.read_text(), re.DOTALL)
    assert len(examples) >= 2
    for example in examples:
        assert _flatten_file(json.loads(example), keys)  # raises ConfigError on an unknown key
