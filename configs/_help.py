"""The text of ``moestack-train --help`` that hydra's template cannot hold by itself: the
version, the README's location and every config field with its value and its comment.

The comments are read from the config dataclasses' source (each beside the class it configures,
assembled in ``moestack/config.py``; one comment per field, a subclass's and its bases'), so
the help and the code cannot drift apart; values come from the composed config,
so ``moestack-train model=small --help`` shows model=small's.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

_WIDTH = 40  # column where the field comments start
_LINE = 100  # where they wrap
_FILLED = {"model.router": "filled from `router`: set router=NAME and router.FIELD=VALUE"}


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class source (same line, else the lines above); a
    field a base class declares has the base's comment (``ModelSchema`` extends
    ``ModelConfig``)."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_own_comments(klass))
    return comments


def _own_comments(cls: type) -> dict[str, str]:
    """The field comments in the source of ``cls`` itself."""
    source = textwrap.dedent(inspect.getsource(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    above: list[str] = []
    field_of_line: dict[int, str] = {}
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line, col = token.start
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if line in field_of_line:
                comments[field_of_line[line]] = text
            elif col == 4:
                above.append(text)
        elif token.type == tokenize.NAME and col == 4 and token.string in names:
            field_of_line[line] = token.string
            if above:
                comments[token.string] = " ".join(above)
        elif token.type == tokenize.NL and previous is not None and previous.type == tokenize.NL:
            above = []  # a blank line ends a comment block
        if token.type == tokenize.NEWLINE:
            above = []
        previous = token
    return comments


def _value(value: Any) -> str:
    """``value`` the way an override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if text == "" or any(c in text for c in " ,[]{}'\"=:"):
        return "'" + text.replace("'", "\\'") + "'"
    return text


def _nested(f: dataclasses.Field) -> type | None:
    """The config class a field holds, or None for a plain value."""
    factory = f.default_factory
    if factory is dataclasses.MISSING:
        return None
    if isinstance(factory, type):
        return factory if dataclasses.is_dataclass(factory) else None
    made = factory()  # a factory of an instance (optim.experts: its population's defaults)
    return type(made) if dataclasses.is_dataclass(made) else None


def _rows(cls: type, values: dict[str, Any], prefix: str) -> list[tuple[str, str]]:
    """(FIELD=VALUE, comment) for every plain field of ``cls``, nested ones below."""
    comments = field_comments(cls)
    rows: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if path in _FILLED:
            rows.append((path, _FILLED[path]))
        elif _nested(f) is not None:
            rows += _rows(_nested(f), values.get(f.name) or {}, path + ".")
        else:
            rows.append((f"{path}={_value(values.get(f.name))}", comments.get(f.name, "")))
    return rows


def _format(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    """Aligned rows, long comments wrapped under their column."""
    lines = []
    for left, comment in rows:
        first = f"{indent}{left:<{_WIDTH}}  "
        wrapped = textwrap.wrap(comment, _LINE - len(indent) - _WIDTH - 2) or [""]
        if len(left) > _WIDTH:  # a long value: its comment starts on the next line
            lines.append(f"{indent}{left}")
            first = " " * len(first)
        lines.append((first + wrapped[0]).rstrip())
        lines += [" " * len(first) + more for more in wrapped[1:]]
    return lines


def fields_text(values: dict[str, Any], choices: dict[str, Any] | None = None) -> str:
    """Every field of TrainConfig: the run's own fields first, then one block per section
    (its docstring's first line and the group option chosen for it)."""
    from moestack.config import TrainConfig

    choices = choices or {}
    plain = [f for f in dataclasses.fields(TrainConfig) if _nested(f) is None]
    comments = field_comments(TrainConfig)
    top = [(f"{f.name}={_value(values.get(f.name))}", comments.get(f.name, "")) for f in plain]
    lines = ["run: " + (TrainConfig.__doc__ or "").strip().splitlines()[0], *_format(top)]
    for f in dataclasses.fields(TrainConfig):
        cls = _nested(f)
        if cls is None:
            continue
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        chosen = f" [{f.name}={choices[f.name]}]" if choices.get(f.name) else " (fields only)"
        lines += ["", f"{f.name}{chosen}: {doc}"]
        lines += _format(_rows(cls, values.get(f.name) or {}, f.name + "."))
    return "\n".join(lines)


def _composed(root: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The composed config without the hydra node, and the chosen group options."""
    values = {
        key: OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        for key, node in ((k, root[k]) for k in root if k != "hydra")
    }
    choices = OmegaConf.select(root, "hydra.runtime.choices", default=None)
    plain = OmegaConf.to_container(choices) if OmegaConf.is_config(choices) else {}
    return values, dict(plain)


def readme() -> str:
    """Where the README is: the checkout's file, else the package description."""
    import moestack

    path = Path(moestack.__file__).resolve().parent.parent / "README.md"
    if path.is_file():
        return str(path)
    return "README.md of the moestack source (also the package description on its index page)"


def render(section: str, root: DictConfig) -> str:
    """One section of the help text; ``$`` doubled for hydra's string.Template."""
    import moestack

    if section == "version":
        text = moestack.__version__
    elif section == "readme":
        text = readme()
    elif section == "fields":
        text = fields_text(*_composed(root))
    else:
        raise ValueError(f"moestack.help:{section} is unknown; use version, readme or fields")
    return text.replace("$", "$$")
