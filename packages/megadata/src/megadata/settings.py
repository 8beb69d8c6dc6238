"""How a recipe's tables become settings: the one loader of every section (`load`), the
checks a field can carry, and the error a recipe that cannot run raises.

Each stage owns a frozen dataclass of its section, whose fields are the keys a recipe may
write there, with their types and defaults (`CleanSettings` in megadata.stages.clean, ...).
`load` refuses a key the dataclass has no field for, naming the nearest field, and a value
of another type, naming the type expected; the dataclass's `__post_init__` refuses values
that its fields' types cannot (two fields that must agree, a choice among names).  Every
message names the recipe file, the section and the key.  As megatrain's config does, an
integer is accepted where a number is expected (and kept as written: the reports show the
recipe's value).
"""

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

TOP_LEVEL = "the top level"  # the label of a recipe's own keys (name, output, ...)


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file, and the section and key."""


@dataclass(frozen=True)
class Check:
    """A condition on a field's value beyond its type, and how the type is then described."""

    description: str  # "a positive integer": the message says "... must be a positive integer"
    test: Callable[[Any], bool] | None = None  # None: the type alone, described thus


PositiveInt = Annotated[int, Check("a positive integer", lambda v: v >= 1)]
Fraction = Annotated[float, Check("a fraction in [0, 1]", lambda v: 0 <= v <= 1)]
PositiveNumber = Annotated[float, Check("a number > 0", lambda v: v > 0)]

_DESCRIPTIONS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a table",
    list: "a list",
}


def load(cls, table, label: str, where: str = ""):
    """`table` (a recipe's TOML table, or a dict given in code) as the settings dataclass
    `cls`, defaults filled in; settings of `cls` already are returned as they are.  `label`
    names the table in messages (`[dedup]`, `source 'news'`, TOP_LEVEL) and `where` comes
    before them (`recipe PATH: `).  RecipeError on an unknown key, a missing one, a value of
    the wrong type or one its dataclass refuses."""
    if isinstance(table, cls):
        return table
    if not isinstance(table, Mapping):
        raise RecipeError(f"{where}{label} must be a table of settings, got {table!r}")
    check_keys(cls, table, label, where)
    hints = typing.get_type_hints(cls, include_extras=True)
    missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in table]
    if missing:
        raise RecipeError(f"{where}{label} has no {missing[0]!r}")
    for key, value in table.items():
        problem = _type_problem(value, hints[key])
        if problem is not None:
            raise RecipeError(f"{where}{_name(label, key)} must be {problem}, got {value!r}")
    try:
        return cls(**table)
    except ValueError as e:  # what __post_init__ refused: its message names the field
        raise RecipeError(f"{where}{e}") from None


def check_keys(cls, table: Mapping, label: str, where: str = "") -> None:
    """Refuse a key of `table` that `cls` has no field for, naming the nearest field."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in table if key not in names]
    if not unknown:
        return
    key = unknown[0]
    near = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise RecipeError(
        f"{where}{label} has no key {key!r}{hint} "
        f"(unknown field(s) {sorted(map(str, unknown))}; expected {sorted(names)})"
    )


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _name(label: str, key: str) -> str:
    """How a message names a key: `[dedup] threshold`, `source 'news': split_mb`, or the
    bare key at the top level."""
    if label == TOP_LEVEL:
        return key
    return f"{label} {key}" if label.startswith("[") else f"{label}: {key}"


def _type_problem(value, annotation) -> str | None:
    """None when `value` fits `annotation`; else what the field must be ("a positive
    integer", "true or false", ...)."""
    kinds = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    if value is None and type(None) in kinds:
        return None
    descriptions = []
    for kind in kinds:
        if kind is type(None):
            continue
        check = None
        if typing.get_origin(kind) is Annotated:
            kind, check = kind.__origin__, kind.__metadata__[0]
        if _fits(value, kind) and (check is None or check.test is None or check.test(value)):
            return None
        descriptions.append(check.description if check else _description(kind))
    return " or ".join(descriptions)


def _is_union(annotation) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def _fits(value, kind) -> bool:
    origin = typing.get_origin(kind) or kind
    if origin is float:  # TOML's 1 is an integer: a number all the same
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if not isinstance(value, origin):
        return False
    if origin is list and typing.get_args(kind):
        (item,) = typing.get_args(kind)
        return all(_fits(v, item) for v in value)
    return True


def _description(kind) -> str:
    origin, args = typing.get_origin(kind) or kind, typing.get_args(kind)
    if origin is list and args:
        return {str: "a list of strings", dict: "a list of tables"}.get(args[0], "a list")
    return _DESCRIPTIONS.get(origin, getattr(origin, "__name__", str(origin)))
