"""The command line's overrides checked against the config before hydra composes them.

Hydra would take ``+optim.lrr=1e-3`` (the advice its own error gives for ``optim.lrr=1e-3``)
and train with the typo ignored, and it answers a value of the wrong type with several lines
and no fix. Here every override's key must name a field of ``TrainConfig`` (the ``model``
node as the command line fills it), a config group (``model=small``) or hydra's own
settings (``hydra.*``, ``hydra/...``); an unknown key, with or without ``+``, ``++`` or
``~``, is refused in one line with the nearest field, and a value of the wrong type in one
line naming the field, the value and the type it takes. A sweep's values (``-m seed=0,1``)
are checked one by one. What this cannot check (an interpolation, a value hydra cannot
parse) is left to hydra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import io
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from moestack.config import TrainConfig
from moestack.errors import MoestackError

HELP = "moestack-train --help lists every field"


def check_command_line(argv: Sequence[str]) -> None:
    """Check the overrides of a ``moestack-train`` command line (its flags set aside, as
    hydra's own parser reads them); raise MoestackError for the first bad one."""
    parsed = hydra_arguments(argv)
    if parsed is not None:
        sweep = bool(parsed.multirun) or any(o.startswith("hydra.mode=") for o in parsed.overrides)
        check_overrides(parsed.overrides, sweep=sweep)


def check_overrides(overrides: Sequence[str], sweep: bool = True) -> None:
    """Raise MoestackError, one line naming the override and the fix, for the first of
    ``overrides`` that sets no field, a value of the wrong type, ``model.router`` (set in
    the ``router`` group), or, outside a sweep, several values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue  # hydra says what it cannot parse
        _check_one(text, override, sweep)


def hydra_arguments(argv: Sequence[str]) -> Any:
    """``argv`` as hydra's own argument parser reads it (its flags, ``.overrides``); None
    when it refuses (hydra then says why). The one reading of the command line."""
    from hydra._internal.utils import get_args_parser

    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        return get_args_parser().parse_args(list(argv))
    return None


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the last of ``overrides`` that sets ``key`` gives it, as written (an
    interpolation unresolved), read by hydra's override parser; None when none sets it (or
    deletes it, or sweeps it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, found = OverridesParser.create(), None
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue  # hydra says what it cannot parse
        if override.key_or_group == key:
            simple = not override.is_delete() and not override.is_sweep_override()
            value = override.value() if simple else None
            found = None if value is None else str(value)
    return found


def _check_one(text: str, override: Any, sweep: bool) -> None:
    """Check one parsed override (``text`` as typed)."""
    key = override.key_or_group
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return
    if key in config_groups():
        _check_group_choice(text, override, sweep)
        return
    if override.package is not None:  # key@package: hydra's word for config groups only
        raise MoestackError(f"{text!r}: {key} is no config group; groups: {_groups_line()}")
    if key == "model.router" or key.startswith("model.router."):
        fix = text.lstrip("+~").replace("model.router", "router", 1)
        raise MoestackError(
            f"{text!r}: the router is configured in one place, the `router` group; write {fix!r}"
        )
    kind = field_type(TrainConfig, key)
    if kind is None:
        raise MoestackError(_unknown(text, override))
    if override.is_add():
        raise MoestackError(
            f"{text!r}: {key} is a field already; write {text.lstrip('+')!r} without the '+'"
        )
    if override.is_delete():
        raise MoestackError(
            f"{text!r}: every field has a value and none can be removed; set it with {key}=VALUE"
        )
    if override.is_sweep_override() and not sweep:
        raise MoestackError(_not_a_sweep(text, key, kind))
    raw = text.split("=", 1)[1] if not override.is_sweep_override() else None
    for value in _values(override):
        _check_value(text, key, kind, value, raw)


def _check_group_choice(text: str, override: Any, sweep: bool) -> None:
    """A config group's option (``model=small``) must be one of its files."""
    key = override.key_or_group
    if override.is_delete():
        return
    options = config_groups()[key]
    if override.is_sweep_override() and not sweep:
        raise MoestackError(f"{text!r}: several options for {key}: add -m to run one job for each")
    for value in _values(override):
        if value is None or (isinstance(value, str) and "${" in value):
            continue
        if not isinstance(value, str) or value not in options:
            near = difflib.get_close_matches(str(value), options, n=1)
            guess = f"did you mean {key}={near[0]}? " if near else ""
            raise MoestackError(
                f"{text!r}: the {key} group has no option {str(value)!r}; {guess}"
                f"its options: {', '.join(options)}"
            )


def _values(override: Any) -> Iterator[Any]:
    """The value, or each value of a sweep (none for a glob or an interval: hydra's)."""
    if not override.is_sweep_override():
        yield override.value()
    elif override.value_type.name in ("CHOICE_SWEEP", "SIMPLE_CHOICE_SWEEP", "RANGE_SWEEP"):
        yield from override.sweep_iterator()


# --------------------------------------------------------------------------- values
def _check_value(text: str, key: str, kind: Any, value: Any, raw: str | None) -> None:
    """Refuse ``value`` (``raw`` as typed, None for one of a sweep's) for the field ``key``
    of type ``kind``, naming what it takes."""
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: resolved, and checked, when hydra composes
    problem = _type_problem(kind, value)
    if problem is None:
        return
    raw = _raw(value) if raw is None else raw
    fix = ""
    if _origin(kind) in (list, tuple) and not isinstance(value, (list, dict)):
        fix = f"; write '{key}=[{raw}]'"
    elif dataclasses.is_dataclass(kind):
        fix = f"; set its fields: {key}.FIELD=VALUE"
    raise MoestackError(f"{text!r}: {key} is {problem}, not {raw!r}{fix}")


def _type_problem(kind: Any, value: Any) -> str | None:
    """What ``kind`` takes, when ``value`` is not one of it (None when it is)."""
    from omegaconf.errors import ValidationError
    from omegaconf.nodes import FloatNode, IntegerNode, StringNode

    if kind is Any:
        return None
    optional = _optional_of(kind)
    if optional is not None:  # X | None: null, or what X takes
        return None if value is None else _type_problem(optional, value)
    if dataclasses.is_dataclass(kind):
        return None if isinstance(value, dict) else "a section"
    if _origin(kind) in (list, tuple):
        item = (typing.get_args(kind) or (Any,))[0]
        wrong = not isinstance(value, list) or any(_type_problem(item, v) for v in value)
        return f"a list of {_PLURAL.get(item, 'values')}" if wrong else None
    if kind is bool:  # stricter than the config library, which reads 2 or "yes" as a bool
        return None if isinstance(value, bool) else _type_name(bool)
    node = {int: IntegerNode, float: FloatNode, str: StringNode}.get(kind)
    if node is None:
        return None
    try:
        node(value=value, is_optional=False)
    except ValidationError:
        return _type_name(kind)
    return None


_PLURAL = {bool: "true/false values", int: "integers", float: "numbers", str: "texts"}


def _type_name(kind: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def _origin(kind: Any) -> Any:
    return typing.get_origin(kind)


def _optional_of(kind: Any) -> Any:
    """``X`` of a field typed ``X | None`` (or ``Optional[X]``); None for any other type."""
    if _origin(kind) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(kind)) == 2 else None


def _raw(value: Any) -> str:
    """``value`` as the command line wrote it (hydra reads true as True, null as None)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return f"[{','.join(_raw(v) for v in value)}]"
    return str(value)


def _not_a_sweep(text: str, key: str, kind: Any) -> str:
    """Several values outside a sweep: a list (brackets), or a sweep (-m)."""
    if _origin(kind) in (list, tuple):
        values = text.split("=", 1)[1]
        return f"{text!r}: {key} is a list: write '{key}=[{values}]' (or add -m to sweep over them)"
    return f"{text!r}: several values for {key}: add -m to run one job for each (a sweep)"


# --------------------------------------------------------------------------- keys
def field_type(config: type, key: str) -> Any:
    """The type of the config field a dotted key names (None when it names none); a field
    typed Any that holds a config node (``TrainConfig.model``) is typed by that node's
    class, as the command line fills it."""
    head, _, rest = key.partition(".")
    fields = (
        {f.name: f for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else {}
    )
    if head not in fields:
        return None
    kind = typing.get_type_hints(config)[head]
    factory = fields[head].default_factory
    if kind is Any and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        kind = factory
    return field_type(kind, rest) if rest else kind


def _field_keys(config: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of ``config``'s fields, sections included."""
    for f in dataclasses.fields(config):
        key = f"{prefix}{f.name}"
        yield key
        kind = field_type(TrainConfig, key)
        if dataclasses.is_dataclass(kind):
            yield from _field_keys(kind, f"{key}.")


@functools.cache
def known_keys() -> tuple[str, ...]:
    """Every key an override may set: the fields and the config groups."""
    return (*_field_keys(TrainConfig), *config_groups())


def _unknown(text: str, override: Any) -> str:
    """The refusal of a key that names no field, with the nearest one."""
    key = override.key_or_group
    near = nearest_key(key)
    if near is None:
        return f"{text!r}: {key} is no field of the config; {HELP}"
    fix = ""
    if not override.is_delete() and not override.is_sweep_override():
        value = text.split("=", 1)[1] if "=" in text else ""
        fix = f" (write '{near}={value}')"
    return f"{text!r}: {key} is no field of the config; did you mean {near}?{fix}; {HELP}"


def nearest_key(key: str) -> str | None:
    """The known key closest to ``key``: the same last name in another section
    (``lr`` -> ``optim.lr``), else the closest spelling, else None."""
    keys = [k for k in known_keys() if not k.startswith("model.router")]  # set as router.*
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    if same_leaf:
        return max(same_leaf, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if near:
        return near[0]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}  # the shortest key per name
    near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[near[0]] if near else None


@functools.cache
def config_groups() -> dict[str, tuple[str, ...]]:
    """Each config group of configs/ (a folder of YAML files) and its options."""
    from importlib.resources import files

    root = files("moestack.configs")
    groups = {}
    for folder in root.iterdir():
        options = sorted(
            p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
        ) if folder.is_dir() else []  # fmt: skip
        if options:
            groups[folder.name] = tuple(options)
    return dict(sorted(groups.items()))


def _groups_line() -> str:
    return ", ".join(config_groups())
