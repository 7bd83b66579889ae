"""Resolving a config: defaults, overridden by a YAML file, overridden by the command line.

A stage's config is resolved as ``dataclass defaults < YAML file < command line``. Keys are the
dataclass's field names; nested dataclasses (the model and the sections of the training config) take
a mapping in YAML and dotted keys on the command line (``--set optim.lr=5e-4``). Values are converted
by the field's type, so ``5e-4`` from YAML (a string to PyYAML) becomes a float and ``"true"`` from
``--set`` a bool. An unknown key is an error that names the closest valid key, or the new place of a
key that moved (a config's ``RENAMED`` mapping).

A field is declared with `opt` or `required`: its default, its help text, the range a number must
lie in, and, for the settings the command line offers, its flag (see `options.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from nmt_cli.errors import NmtError, shown

# Choices shared by the training and translation configs.
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]


def opt(default: Any, help: str, *, flag: str | None = None, short: str | None = None,
        at_least: float | None = None, above: float | None = None, at_most: float | None = None,
        below: float | None = None) -> Any:
    """A dataclass field with its help text (shown by `nmt CMD --help`), its command-line flag if it
    has one (``"--name"``; a bool's ``"--x/--no-x"`` offers both; `short` is a dash and a letter) and,
    for numbers, the range a value must lie in (each number of a tuple, too)."""
    bounds = {"at_least": at_least, "above": above, "at_most": at_most, "below": below}
    bounds = {k: v for k, v in bounds.items() if v is not None}
    metadata = {"help": help, **_cli(flag, short, False, None), **bounds}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def required(help: str, *, flag: str | None = None, short: str | None = None, argument: bool = False,
             metavar: str | None = None) -> Any:
    """A field the user must give (an input or output folder): a flag, or the command's positional
    `argument` (shown as `metavar`, default: the field's name)."""
    return dataclasses.field(default=None, metadata={"help": help, "required": True,
                                                     **_cli(flag, short, argument, metavar)})


def _cli(flag: str | None, short: str | None, argument: bool, metavar: str | None) -> dict[str, Any]:
    assert not (argument and flag), "a field is a positional argument or a flag, not both"
    assert flag or not short, "a short form needs a flag"
    values = {"flag": flag, "short": short, "argument": argument or None, "metavar": metavar}
    return {k: v for k, v in values.items() if v is not None}


def _copy(value: Any) -> Any:
    return dataclasses.replace(value) if dataclasses.is_dataclass(value) else type(value)(value)


def help_of(field: dataclasses.Field) -> str:
    """The help text of `field`, with its default, for a Typer option."""
    text = field.metadata.get("help", "")
    if field.metadata.get("required"):
        return text
    default = _default(field)
    if default is None:  # "not set": the help text says what happens then
        return text
    return f"{text} \\[default: {_show(default)}]"  # escaped: Typer renders help as rich markup


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(_show(v) for v in value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Building a config from layers of raw values


def resolve(cls: type, yaml_file: Path | None, cli: dict[str, Any], sets: list[str] | None = None,
            base: Any = None) -> Any:
    """Build `cls` from defaults (or `base`), a YAML file and command-line values.

    `cli` holds the Typer options the user gave (None means "not given"); `sets` holds the generic
    ``key=value`` overrides. Both win over the YAML file.
    """
    layers = [] if yaml_file is None else yaml_layers(Path(yaml_file))
    given = {k: v for k, v in cli.items() if v is not None}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise NmtError(f"--set expects key=value, got {shown(item)}")
        _put_dotted(given, key.strip(), value)
    layers.append(("the command line", given))
    return build(cls, layers, base)


def yaml_layers(path: Path, including: tuple[Path, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """The layers of a YAML config, the files it includes first: a top-level ``include: OTHER.yaml``
    (relative to the file) reads OTHER first and lets this file override it, section by section, so
    a variation of a recipe names only what it changes."""
    data = read_yaml(path)
    parent = data.pop("include", None)
    if parent is None:
        return [(str(path), data)]
    if not isinstance(parent, str):
        raise NmtError(f"{path}: 'include' takes the path of one YAML file, got {shown(parent)}")
    other = path.parent / parent
    if other.resolve() in (*including, path.resolve()):
        raise NmtError(f"{path}: 'include: {parent}' includes itself (through {other})")
    return [*yaml_layers(other, (*including, path.resolve())), (str(path), data)]


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = read_small_text(Path(path), "YAML config", MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise NmtError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise NmtError(f"cannot read config file {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise NmtError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NmtError(f"{path} must hold a mapping of option names to values, not {type(data).__name__}")
    return data


# The largest manifest or checksums file (each is read whole): kilobytes in practice. A config is a
# few kB.
MAX_SMALL_FILE_BYTES = 16 << 20
MAX_CONFIG_BYTES = 1 << 20


def read_small_text(path: Path, what: str, limit: int = MAX_SMALL_FILE_BYTES) -> str:
    """The whole of a small UTF-8 file (a YAML config here; a manifest or checksums file through
    `artifacts`, which cannot be imported here), refused if it is over `limit` bytes (unbounded, a
    link to /dev/zero would fill the memory). OSError and UnicodeDecodeError pass to the caller,
    which knows what the file is for."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise NmtError(f"{path}: a {what} of over {limit:,} bytes; this is not the {what} meant here "
                       "(a binary file, or a device such as /dev/zero?)")
    return data.decode("utf-8")


def _put_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise NmtError(f"--set {key}: '{part}' is not a group of options")
    target[leaf] = value


def build(cls: type, layers: list[tuple[str, dict[str, Any]]], base: Any = None, prefix: str = "") -> Any:
    """Apply each (source, mapping) layer in order on top of `base` (default: `cls()` defaults).
    `prefix` names the group in messages (``model.``)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {name: getattr(base, name) if base is not None else _default(f) for name, f in fields.items()}
    hints = typing.get_type_hints(cls)
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # built once from all layers: no half-set group
    for source, mapping in layers:
        for key, raw in mapping.items():
            if not isinstance(key, str):
                raise NmtError(f"{source}: option names are words, got {shown(key)}; valid keys: "
                               f"{', '.join(fields)}")
            if key not in values:
                raise NmtError(_unknown_key(cls, key, source, prefix))
            if dataclasses.is_dataclass(hints[key]):
                if not isinstance(raw, dict):
                    raise NmtError(f"{source}: '{prefix}{key}' is a group of options and takes a mapping, "
                                   f"got {shown(raw)}")
                groups.setdefault(key, []).append((source, raw))
            else:
                values[key] = convert(raw, hints[key], f"{source}: '{prefix}{key}'")
                _check_range(values[key], fields[key].metadata, f"{source}: '{prefix}{key}'")
    for key, group_layers in groups.items():
        values[key] = build(hints[key], group_layers, values[key], f"{prefix}{key}.")
    for f in fields.values():
        if f.metadata.get("required") and values[f.name] is None:
            raise NmtError(f"missing required option '{f.name}' ({f.metadata.get('help', '')})")
    return cls(**values)


def _check_range(value: Any, metadata: Any, where: str) -> None:
    """Refuse a number outside the field's declared range (see `opt`)."""
    numbers = value if isinstance(value, tuple) else (value,)
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        for bound, fails, words in (("at_least", float.__lt__, "at least"), ("above", float.__le__, "above"),
                                    ("at_most", float.__gt__, "at most"), ("below", float.__ge__, "below")):
            if bound in metadata and fails(float(number), float(metadata[bound])):
                raise NmtError(f"{where} must be {words} {metadata[bound]:g}; got {shown(value)}")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def _unknown_key(cls: type, key: str, source: str, prefix: str = "") -> str:
    moved = getattr(cls, "RENAMED", {}).get(key)
    if moved is not None:
        return f"{source}: '{prefix}{key}' is now '{prefix}{moved}'"
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
    return f"{source}: unknown option '{prefix}{key}' for {cls.__name__}{hint}"


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a raw YAML/CLI value to type `tp`, or raise NmtError naming `where`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in {"none", "null", ""}):
            return None
        return convert(value, args[0], where)
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if value == choice or str(value) == str(choice):
                return choice
        raise NmtError(f"{where} must be one of {', '.join(map(str, choices))}; got {shown(value)}")
    if origin is tuple:
        return _convert_tuple(value, tp, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (str, int)) and str(value).strip().lower() in _TRUE | _FALSE:
            return str(value).strip().lower() in _TRUE
        raise NmtError(f"{where} must be true or false; got {shown(value)}")
    if tp is int:
        return _convert_int(value, where)
    if tp is float:
        if isinstance(value, bool):
            raise NmtError(f"{where} must be a number; got {shown(value)}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise NmtError(f"{where} must be a number; got {shown(value)}") from None
        if not math.isfinite(number):  # no setting means anything with nan or inf; 0 is "off" where allowed
            raise NmtError(f"{where} must be a finite number; got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise NmtError(f"{where} must be a string; got {shown(value)}")
        return str(value)
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise NmtError(f"{where} must be a path; got {shown(value)}")
        return Path(value)
    raise TypeError(f"config field type {tp} is not supported")  # a bug in a dataclass, not user error


def _convert_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise NmtError(f"{where} must be a whole number; got {shown(value)}")
    if isinstance(value, int):
        return value
    try:
        number = float(str(value).replace("_", ""))
    except ValueError:
        raise NmtError(f"{where} must be a whole number; got {shown(value)}") from None
    if not number.is_integer():
        raise NmtError(f"{where} must be a whole number; got {shown(value)}")
    return int(number)


def _convert_tuple(value: Any, tp: Any, where: str) -> tuple:
    args = get_args(tp)
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        wanted = "a path or a list of paths" if args and args[0] is Path else "a list"
        raise NmtError(f"{where} must be {wanted}; got {shown(value)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(convert(v, args[0], where) for v in items)
    if len(items) != len(args):
        raise NmtError(f"{where} must have {len(args)} values; got {shown(value)}")
    return tuple(convert(v, a, where) for v, a in zip(items, args, strict=True))


# ---------------------------------------------------------------------------------------------
# Writing a resolved config


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain mapping of `cfg` (paths as strings) that `build` reads back to an equal config."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`to_dict`'s nested mapping as dotted keys (``optim.lr``), the keys `--set` takes."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
