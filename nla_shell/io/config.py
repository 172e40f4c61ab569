"""Run configuration: frozen dataclasses read from YAML plus `key=value` overrides.

Every command (train, sft, eval, datagen) describes its settings as a frozen dataclass
whose field annotations are the schema: `load_dataclass(cls, mapping, overrides)` checks
keys against the fields, coerces values to the annotated types and constructs `cls`,
whose `__post_init__` calls `normalize_fields(self)` and then its own range checks.
Supported annotations: `str`, `int`, `float`, `bool`, `Literal[...]` (the choices),
unions of them (`X | None`, `int | Literal["auto"]`), and `tuple[X, ...]`.

Every problem is a `ConfigError` whose message names the key, the bad value and the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from nla_shell.io.files import write_text_atomically

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the bad value and the fix."""


def require(ok: bool, key: str, value: Any, fix: str) -> None:
    """A ConfigError naming the key, its value and the fix, unless ok."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: {fix}")


# --------------------------------------------------------------------------- generic loader


def load_dataclass(
    cls: type[T], mapping: Mapping[str, Any], overrides: Sequence[str] = ()
) -> T:
    """Build the frozen dataclass `cls` from a mapping (e.g. parsed YAML) and `key=value` overrides.

    Overrides win over the mapping; their keys may use the reference's CLI spelling
    (`--num-steps=3`). Strings are parsed into the annotated type both here and from YAML
    (PyYAML reads `5e-6` as a string): `true/false/yes/no/on/off`, integers, floats,
    `null`/`none` for optional fields, and comma-separated lists for tuple fields.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"a config must be a mapping of key: value, got {type(mapping).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    raw: dict[str, Any] = {}
    for key, value in mapping.items():
        raw[_known_key(cls, names, key)] = value
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value (e.g. num_steps=3)")
        raw[_known_key(cls, names, key.strip().lstrip("-").replace("-", "_"))] = value.strip()
    missing = [
        f.name for f in dataclasses.fields(cls)
        if f.name not in raw
        and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"missing required config key(s) {', '.join(map(repr, missing))}; give them as "
            f"{' '.join('--' + k.replace('_', '-') + ' VALUE' for k in missing)}, as key=value overrides or in the YAML"
        )
    hints = _type_hints(cls)
    return cls(**{k: _coerce(k, hints[k], v, parse_strings=True) for k, v in raw.items()})


def normalize_fields(obj: Any) -> None:
    """Type-check a dataclass instance's fields against their annotations, in place.

    Call first in `__post_init__`. Values are not parsed from strings here (that is the
    loader's job), but widened where lossless: an int for a float field becomes a float,
    a list for a tuple field becomes a tuple.
    """
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = _coerce(f.name, hints[f.name], getattr(obj, f.name), parse_strings=False)
        # The dataclass is frozen; this runs during construction, before anyone can see it.
        object.__setattr__(obj, f.name, value)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal after it), read from the source of `cls` and of the
    dataclasses it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of the fields `cls` itself declares."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value
    return docs


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    *,
    cls: type[Any],
) -> Any:
    """Read a YAML mapping (None: start empty), apply `key=value` overrides, build `cls`."""
    mapping: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from e
        try:
            mapping = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
        if mapping is None:  # an empty file
            mapping = {}
        if not isinstance(mapping, Mapping):
            raise ConfigError(
                f"config file {str(path)!r} must hold a mapping of key: value, "
                f"not a {type(mapping).__name__}"
            )
    return load_dataclass(cls, mapping, overrides)


def config_defaults(cls: type) -> dict[str, Any]:
    """Each field's default, for the fields that have one (a run saved before a key existed ran at it)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain YAML/JSON types (tuples become lists), in field order."""
    return {
        f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v
        for f in dataclasses.fields(cfg)
    }


def save_config(cfg: Any, path: str | os.PathLike[str]) -> None:
    """Write the resolved config as YAML that `load_config` reads back to an equal config.

    Written to a temp file then renamed, so a crash never leaves a truncated config.yaml.
    """
    write_text_atomically(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------- coercion


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Annotations are strings under `from __future__ import annotations`; resolve once.
    return typing.get_type_hints(cls)


def _known_key(cls: type, names: list[str], key: Any) -> str:
    if isinstance(key, str) and key in names:
        return key
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        f"unknown config key {key!r} for {cls.__name__}; {hint}valid keys: {', '.join(names)}"
    )


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NULL = {"null", "none", "~", ""}


def _coerce(key: str, tp: Any, value: Any, *, parse_strings: bool) -> Any:
    """`value` as type `tp`, or a ConfigError naming the key, the value and what is expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def bad() -> ConfigError:
        return ConfigError(
            f"config key '{key}' = {value!r} ({type(value).__name__}) is invalid: "
            f"expected {_describe(tp)}"
        )

    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        # A choice spelled like null ("none" of Literal["rl", "none"] | None) is that choice, not null.
        if value in [choice for arm in arms if typing.get_origin(arm) is Literal for choice in typing.get_args(arm)]:
            return value
        if value is None or (parse_strings and isinstance(value, str) and value.lower() in _NULL):
            if type(None) in args:
                return None
            raise bad()
        for arm in arms:  # the first arm that takes the value
            try:
                return _coerce(key, arm, value, parse_strings=parse_strings)
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        if value not in args:
            raise bad()
        return value
    if origin is tuple:
        items = value
        if parse_strings and isinstance(value, str):
            items = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(items, (list, tuple)):
            raise bad()
        try:
            return tuple(_coerce(key, args[0], v, parse_strings=parse_strings) for v in items)
        except ConfigError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if parse_strings and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if parse_strings and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif parse_strings and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise bad() from None
        else:
            raise bad()
        # A nan/inf setting is never intended, and would slip past every range check.
        if not math.isfinite(number):
            raise bad()
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"config field '{key}' has an unsupported annotation {tp!r}")


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = " or ".join(_describe(a) for a in args if a is not type(None))
        return f"{arms}, or null" if type(None) in args else arms
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list (YAML list or comma-separated) whose items are each {_describe(args[0])}"
    return {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string (quote it in YAML if it looks like a number or boolean)",
    }[tp]
