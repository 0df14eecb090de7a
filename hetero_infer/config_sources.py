"""Where configuration values come from, and how they become a validated Config.

Sources, lowest to highest precedence: defaults < named preset < JSON file (`--config`) <
`HETERO_*` environment variables < CLI flags. Nested keys are spelled with `_` in env
names and `-` in flags: `serving.port` is `HETERO_SERVING_PORT` and `--serving-port`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hetero_common.config import PRESETS, CommandConfig, Config
from hetero_common.errors import ConfigError

# Short spellings users know from the seed docs.
KEY_ALIASES = {"cuda_graph": "enable_cuda_graphs"}  # also in a file, as HETERO_CUDA_GRAPH and --cuda-graph
ENV_ALIASES = {"HETERO_MAX_BLOCKS": "max_num_blocks",
               **{"HETERO_" + alias.upper(): name for alias, name in KEY_ALIASES.items()}}
KIND_ALIASES = {"local_engine": "scheduler"}


# ---------------------------------------------------------------------------------------
# Field discovery: every leaf key, its dotted path and its type, from the dataclasses.

@dataclass(frozen=True)
class ConfigKey:
    path: tuple[str, ...]
    type: Any

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def env_name(self) -> str:
        return "HETERO_" + "_".join(self.path).upper()

    @property
    def flag(self) -> str:
        return "--" + "-".join(self.path).replace("_", "-")


def config_keys(cls: type = Config, prefix: tuple[str, ...] = ()) -> list[ConfigKey]:
    hints = typing.get_type_hints(cls)
    keys: list[ConfigKey] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and tp is not CommandConfig:
            keys.extend(config_keys(tp, prefix + (f.name,)))
        else:
            keys.append(ConfigKey(prefix + (f.name,), tp))
    return keys


def _parse(key: ConfigKey, raw: Any) -> Any:
    """Coerce a value from JSON, env or CLI to the key's type, or raise ConfigError."""
    tp = key.type
    optional = typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in typing.get_args(tp)
    if optional:
        if raw is None or raw == "" or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    try:
        if tp is CommandConfig:
            data = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(data, Mapping):
                raise ValueError("expected an object {program, args}")
            unknown = set(data) - {"program", "args"}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            return CommandConfig(program=str(data.get("program", "")), args=[str(a) for a in data.get("args", [])])
        if typing.get_origin(tp) is list:  # a JSON list, or a comma-separated string (env, flags)
            if isinstance(raw, str):
                raw = json.loads(raw) if raw.strip().startswith("[") else [p.strip() for p in raw.split(",") if p.strip()]
            if not isinstance(raw, list):
                raise ValueError("expected a list")
            return [str(v) for v in raw]
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(raw)
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError("expected a number")
            return float(raw)
        if tp is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError("expected a string")
            value = str(raw)
            return KIND_ALIASES.get(value, value) if key.path[-1] == "kind" else value
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        shown = "<redacted>" if key.path[-1] in ("api_keys", "admin_api_keys") else repr(raw)  # keys are never printed
        raise ConfigError(f"config key '{key.dotted}' = {shown}: {exc}") from exc
    raise ConfigError(f"config key '{key.dotted}' has an unsupported type {tp}")


def _set(config: Config, key: ConfigKey, value: Any) -> None:
    target: Any = config
    for part in key.path[:-1]:
        target = getattr(target, part)
    setattr(target, key.path[-1], value)


def _flatten_file(data: Mapping[str, Any], keys: dict[tuple[str, ...], ConfigKey], prefix: tuple[str, ...] = ()) -> dict[ConfigKey, Any]:
    out: dict[ConfigKey, Any] = {}
    spelled: dict[ConfigKey, str] = {}  # the name each key was set under (a key, or its alias)
    for name, value in data.items():
        path = prefix + (name,)
        target = (KEY_ALIASES[name],) if not prefix and name in KEY_ALIASES else path
        if target in keys:
            key = keys[target]
            if key in out and out[key] != value:
                raise ConfigError(f"config keys '{spelled[key]}' and '{'.'.join(path)}' (one is the other's alias) "
                                  f"disagree ({out[key]!r} and {value!r}); keep one")
            out[key], spelled[key] = value, ".".join(path)
        elif isinstance(value, Mapping) and any(k[: len(path)] == path for k in keys):
            out.update(_flatten_file(value, keys, path))
        elif path != ("preset",):
            raise ConfigError(f"unknown config key '{'.'.join(path)}'; valid keys are listed in docs/configuration.md")
    return out


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli_overrides: Mapping[str, Any] | None = None,
    preset: str | None = None,
) -> Config:
    """Build and validate the config from all sources. `cli_overrides` maps dotted keys to values."""
    env = os.environ if env is None else env
    keys = {k.path: k for k in config_keys()}
    file_data: dict[str, Any] = {}
    config_file = config_file or env.get("HETERO_CONFIG")
    if config_file:
        try:
            file_data = json.loads(Path(config_file).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {config_file} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid JSON: {exc}") from exc
        if not isinstance(file_data, dict):
            raise ConfigError(f"config file {config_file} must hold a JSON object")
    preset = preset or env.get("HETERO_PRESET") or file_data.get("preset")
    config = Config()
    layers: list[dict[ConfigKey, Any]] = []
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        layers.append({keys[(name,)]: value for name, value in PRESETS[preset].items()})
    layers.append(_flatten_file(file_data, keys))
    env_layer: dict[ConfigKey, Any] = {}
    for key in keys.values():
        if key.env_name in env:
            env_layer[key] = env[key.env_name]
    for alias, name in ENV_ALIASES.items():
        if alias in env and keys[(name,)] not in env_layer:
            env_layer[keys[(name,)]] = env[alias]
    layers.append(env_layer)
    cli_layer: dict[ConfigKey, Any] = {}
    for dotted, value in (cli_overrides or {}).items():
        path = tuple(dotted.split("."))
        if path not in keys:
            raise ConfigError(f"unknown config key '{dotted}'")
        cli_layer[keys[path]] = value
    layers.append(cli_layer)
    for layer in layers:
        for key, value in layer.items():
            _set(config, key, _parse(key, value))
    return config.validate()


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config key (`--block-size`, `--serving-port`, ...), plus --config and --preset."""
    group = parser.add_argument_group("configuration (CLI > HETERO_* env > --config file > preset > defaults)")
    group.add_argument("--config", dest="config_file", help="JSON config file")
    group.add_argument("--preset", choices=sorted(PRESETS), help="named preset from the seed docs")
    for key in config_keys():
        aliases = ["--" + alias.replace("_", "-") for alias, name in KEY_ALIASES.items() if name == key.dotted]
        group.add_argument(key.flag, *aliases, dest="cfg:" + key.dotted, default=None, metavar="VALUE",
                           help=f"{key.dotted} (env {key.env_name})")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    overrides = {name[4:]: value for name, value in vars(args).items() if name.startswith("cfg:") and value is not None}
    return load_config(getattr(args, "config_file", None), env, overrides, getattr(args, "preset", None))
