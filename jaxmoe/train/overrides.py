"""``--config.KEY=VALUE`` command-line overrides of a config file (ml_collections style).

``KEY`` is a dotted path (``steps``, ``optim.learning_rate``, ``mesh.context``,
``model.moe.dispatch``); the typed config (:mod:`jaxmoe.config`) is the schema, so a key the
config file leaves at its default can be set too. The value is parsed by the field's type: ints,
floats, bools (``true/false/1/0/yes/no``), strings as given, tuples with ``ast.literal_eval``
(or a bare comma-separated list). An unknown key names the allowed keys at its level; a value
of the wrong type names the key and the expected type.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxmoe.config import OPTIONAL_SECTIONS, SECTIONS, Config, ConfigError, ModelConfig, TrainConfig

PREFIX = "--config."


class OverrideError(ConfigError):
    """A ``--config.KEY=VALUE`` flag names no field or holds a value of the wrong type."""


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separates ``--config.KEY=VALUE`` and ``--config.KEY VALUE`` flags from the other arguments.

    Returns:
        ``([(key, value_text), ...], remaining argv)`` in the order given.
    """
    overrides, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(PREFIX):
            key, eq, value = arg[len(PREFIX) :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise OverrideError(f"flag {arg} has no value: use {arg}=VALUE")
                value = argv[i + 1]
                i += 1
            if not key:
                raise OverrideError(f"flag {arg!r} names no config key: use --config.KEY=VALUE")
            overrides.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def _root_schema() -> dict[str, Any]:
    """Top-level key -> default value (a dataclass instance for sections), as config files spell them."""
    defaults = Config()
    schema = {name: getattr(defaults, name) for name in SECTIONS}
    schema.update({f.name: getattr(defaults.train, f.name) for f in dataclasses.fields(TrainConfig)})
    return schema


def _schema_of(node: Any) -> dict[str, Any]:
    schema = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, ModelConfig):  # a section a model may lack (None) is still a section of keys
        schema.update({name: cls() for name, cls in OPTIONAL_SECTIONS.items() if schema[name] is None})
    return schema


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise OverrideError(f"--config.{key}: expected a bool (true/false), got {text!r}")


def _parse_tuple(key: str, text: str) -> tuple:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if any(c in text for c in "()[]'\""):
            raise OverrideError(f"--config.{key}: expected a tuple, e.g. \"('a', 'b')\", got {text!r}") from None
        value = [v.strip() for v in text.split(",") if v.strip()]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise OverrideError(f"--config.{key}: expected a tuple, got {text!r}")
    return tuple(value)


def parse_value(key: str, text: str, default: Any) -> Any:
    """``text`` as the type of ``default`` (the field's default value)."""
    if isinstance(default, bool):
        return _parse_bool(key, text)
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise OverrideError(f"--config.{key}: expected an int, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise OverrideError(f"--config.{key}: expected a float, got {text!r}") from None
    if isinstance(default, tuple):
        return _parse_tuple(key, text)
    return text


def _as_dict(cd: Any) -> dict:
    if hasattr(cd, "to_dict"):
        cd = cd.to_dict()
    if not isinstance(cd, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(cd).__name__}")
    return {k: _as_dict(v) if isinstance(v, Mapping) or hasattr(v, "to_dict") else v for k, v in cd.items()}


def apply_overrides(cd: Any, overrides: Sequence[tuple[str, str]]) -> dict:
    """A copy of the config dict ``cd`` (ConfigDict or nested dict) with each ``(key, text)`` set.

    Raises:
        OverrideError: naming the key and the allowed keys at its level, or the expected type.
    """
    out = copy.deepcopy(_as_dict(cd))
    for key, text in overrides:
        parts = key.split(".")
        schema, node = _root_schema(), out
        for depth, name in enumerate(parts):
            where = ".".join(parts[:depth]) or "the top level"
            if name not in schema:
                raise OverrideError(f"--config.{key}: unknown key {name!r}; allowed keys at {where}: {sorted(schema)}")
            default = schema[name]
            last = depth == len(parts) - 1
            if dataclasses.is_dataclass(default):
                if last:
                    raise OverrideError(
                        f"--config.{key}: {key} is a section; set one of its keys: "
                        f"{', '.join(f'{key}.{k}' for k in sorted(_schema_of(default)))}"
                    )
                child = node.get(name)
                if child is None:
                    child = node[name] = {}
                if not isinstance(child, dict):
                    raise OverrideError(f"--config.{key}: the config holds {child!r} at {name!r}, not a section")
                schema, node = _schema_of(default), child
            elif not last:
                raise OverrideError(f"--config.{key}: {'.'.join(parts[: depth + 1])} is a value, not a section")
            else:
                node[name] = parse_value(key, text, default)
    return out


def section_overrides(values: dict, overrides: Sequence[tuple[str, str]], defaults: Any) -> dict:
    """A job section's ``values`` (``rl``, ``vl``) with each ``--config.SECTION.KEY=VALUE`` set,
    typed by the section dataclass instance ``defaults``."""
    out = copy.deepcopy(values)
    for key, text in overrides:
        parts = key.split(".")[1:]
        node, default = out, defaults
        for depth, name in enumerate(parts):
            fields = {f.name for f in dataclasses.fields(default)}
            if name not in fields:
                raise OverrideError(f"--config.{key}: unknown key {name!r}; allowed keys: {sorted(fields)}")
            default = getattr(default, name)
            if depth < len(parts) - 1:
                if not dataclasses.is_dataclass(default):
                    raise OverrideError(f"--config.{key}: {name} is a value, not a section")
                node = node.setdefault(name, {})
            elif dataclasses.is_dataclass(default):
                raise OverrideError(f"--config.{key}: {name} is a section; set one of its keys")
            elif isinstance(default, tuple):
                node[name] = tuple(v.strip() for v in text.split(",") if v.strip())
            else:
                node[name] = parse_value(key, text, default)
    return out
