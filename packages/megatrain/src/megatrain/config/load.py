"""Reading a config: a TOML file and `section.field=value` overrides, each value checked
against its field's type and choices (`load_config`).
"""

import dataclasses
import sys
import typing
from pathlib import Path

from megatrain.config.errors import ConfigError
from megatrain.config.sections import _SECTION_TYPES, CHOICES, Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _type_name(annotation) -> str:
    return " or ".join(
        getattr(k, "__name__", str(k)) for k in typing.get_args(annotation) or [annotation]
    )


def _coerce(where: str, value, default, annotation):
    """Check a TOML value against a field's type; ints are accepted for floats."""
    kinds = typing.get_args(annotation) or (annotation,)
    # TOML has no null: "none" clears a field that may be None (and is not a string field,
    # where it could be a value; a pipeline layout, a string or a list, is never "none").
    spelled_none = (
        isinstance(value, str)
        and value.lower() in ("none", "null")
        and (str not in kinds or list in kinds)
    )
    if value is None or spelled_none:
        if type(None) in kinds:
            return None
        raise ConfigError(f"{where}: a value is required (default {default!r})")
    for want in kinds:
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, want) and not (want is int and isinstance(value, bool)):
            return value
    raise ConfigError(
        f"{where}: expected {_type_name(annotation)}, got {value!r} ({type(value).__name__})"
    )


def _apply(config: Config, section: str, key: str, value, source: str) -> None:
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"{source}: unknown section [{section}]; known: {', '.join(_SECTION_TYPES)}"
        )
    fields = {f.name: f for f in dataclasses.fields(_SECTION_TYPES[section])}
    if key not in fields:
        raise ConfigError(
            f"{source}: unknown field {section}.{key}; [{section}] has: {', '.join(fields)}"
        )
    where = f"{source}: {section}.{key}"
    f = fields[key]
    value = _coerce(where, value, f.default, f.type)
    choices = CHOICES.get((section, key))
    if choices and value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    setattr(getattr(config, section), key, value)


def _parse_override(text: str):
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(
            f"override {text!r}: expected section.field=value, e.g. training.train_iters=100"
        )
    name, raw = text.split("=", 1)
    section, key = name.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as bf16 or a path
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a config file (or start from the defaults) and apply `section.field=value` overrides."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see pipelines/models/)")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: not valid TOML: {e}") from e
        config.name = path.stem
        apply_sections(config, data, str(path))
    apply_overrides(config, overrides)
    return config


def unknown_field(data: dict) -> str | None:
    """The first [section] or section.field of `data` ({section: {field: value}}, as
    `Config.to_dict` writes it) that this megatrain's Config does not have, or None."""
    for section, values in data.items():
        if section == "name":
            continue
        if section not in _SECTION_TYPES:
            return f"[{section}]"
        fields = {f.name for f in dataclasses.fields(_SECTION_TYPES[section])}
        for key in values if isinstance(values, dict) else ():
            if key not in fields:
                return f"{section}.{key}"
    return None


def apply_sections(config: Config, data: dict, source: str) -> None:
    """Set the fields of `data` ({section: {field: value}}, a config file's or a checkpoint's
    meta.json "config") on `config`, each checked as a config file's; errors name `source`."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: top-level key {section!r} must be a [section] of fields")
        for key, value in values.items():
            _apply(config, section, key, value, source)


def apply_overrides(config: Config, overrides: list[str]) -> None:
    """Apply `section.field=value` overrides to `config`."""
    for text in overrides:
        section, key, value = _parse_override(text)
        _apply(config, section, key, value, f"override {text!r}")
