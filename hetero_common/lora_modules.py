"""The `lora_modules` setting: LoRA adapters loaded at start, `name=path,name=path` (issue 41). Slot i + 1 holds
the i-th; slot 0 is the base model (NewSequence.lora_slot)."""

from __future__ import annotations

import re

from hetero_common.errors import ConfigError, ModelNotFoundError, ValidationError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
NAME_RULE = "must start with a letter or digit and hold at most 200 letters, digits and . _ : / -"


def check_adapter_name(name: str, served_model: str) -> None:
    """A name a LoRA adapter may be loaded under (LoadLoraAdapter); ValidationError naming `name` if not."""
    if not _NAME.match(name):
        raise ValidationError(f"name {name!r} {NAME_RULE}", "name")
    if name == served_model:
        raise ValidationError(f"name {name!r} is the served model's; give the adapter a name of its own", "name")


def parse_lora_modules(value: str, max_loras: int) -> list[tuple[str, str]]:
    """[(name, path)] in slot order; ConfigError naming the entry that is wrong."""
    modules: list[tuple[str, str]] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"config key 'lora_modules': entry {entry!r} must be name=path")
        if not _NAME.match(name):
            raise ConfigError(f"config key 'lora_modules': adapter name {name!r} {NAME_RULE}")
        if any(name == known for known, _ in modules):
            raise ConfigError(f"config key 'lora_modules': adapter name {name!r} is given twice")
        modules.append((name, path))
    if len(modules) > max_loras:
        raise ConfigError(f"config key 'lora_modules' lists {len(modules)} adapters, more than max_loras ({max_loras}); "
                          "raise max_loras")
    return modules


def lora_cache_salt(cache_salt: str, adapter: str) -> str:
    """The prefix-cache salt of a request served with `adapter`: two adapters (or an adapter and the base
    model) never share KV blocks of the same prompt."""
    return f"{cache_salt}\x1flora:{adapter}" if adapter else cache_salt


def lora_slot(lora_modules: str, max_loras: int, adapter: str) -> int:
    """The worker slot of the adapter named `adapter` (0: the base model); ModelNotFoundError if none is."""
    if not adapter:
        return 0
    names = [name for name, _ in parse_lora_modules(lora_modules, max_loras)]
    if adapter not in names:
        raise ModelNotFoundError(f"LoRA adapter {adapter!r} is not loaded; loaded: {', '.join(names) or 'none'}",
                                 "model")
    return names.index(adapter) + 1
