"""The options of an `nmt` command, generated from its config dataclass.

A field declared with a `flag` (``opt(default, "help", flag="--name")``) becomes an option of the
command, one declared with ``argument=True`` its positional argument; the help text, with the
default, is the field's. Fields of nested sections (``TrainConfig.batch.max_tokens``) are options
too. An option the user did not give is None and leaves the YAML value or the default alone: the
command hands `core.resolve` only what was given, as a nested mapping. Every field, with a flag or
without, is reachable through ``--config FILE.yaml`` and ``--set key=value``.

Typer reads a command's parameters from its function's signature, so `command` builds a function
whose ``__signature__`` and ``__annotations__`` list one parameter per option.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import typer

from nmt_cli.config.core import help_of

ConfigFile = Annotated[
    Optional[Path],
    typer.Option("--config", help="YAML file of option values (overridden by the command line)"),
]
Sets = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="override any config field: --set key=value (repeatable; model.dropout=0.3)"),
]
# Called with the options given (a nested mapping of field names), the --config file and the --set items.
Handler = Callable[[dict[str, Any], Optional[Path], Optional[list[str]]], None]


def parameters(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], inspect.Parameter]]:
    """(field path, Typer parameter) of each field of `cls` and its sections with a flag or argument."""
    found = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp, where = hints[field.name], (*path, field.name)
        if dataclasses.is_dataclass(tp):
            found += parameters(tp, where)
        elif field.metadata.get("argument"):
            info = typer.Argument(help=help_of(field), metavar=field.metadata.get("metavar"),
                                  show_default=False, **_parser(tp))
            annotation = Annotated[_cli_type(tp), info]
            found.append((where, _parameter(field.name, annotation, inspect.Parameter.empty)))
        elif "flag" in field.metadata:
            flags = [field.metadata["flag"], *filter(None, [field.metadata.get("short")])]
            info = typer.Option(*flags, help=help_of(field), show_default=False, **_parser(tp))
            annotation = Annotated[Optional[_cli_type(tp)], info]
            found.append((where, _parameter("__".join(where), annotation, None)))
    return found


def _parameter(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _cli_type(tp: Any) -> Any:
    """The type Typer parses a field's command-line value as (`core.convert` then converts it)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _cli_type(next(a for a in get_args(tp) if a is not type(None)))
    if origin is Literal:  # Typer lists the choices in --help
        return tp
    if origin is tuple and get_args(tp)[1:] == (Ellipsis,):
        return list[get_args(tp)[0]]
    if tp in (bool, int, float, str, Path):
        return tp
    raise TypeError(f"a config field of type {tp} cannot have a flag")  # a bug in a config, not user error


def _parser(tp: Any) -> dict[str, Any]:
    """A `Literal` field's value passes through Typer unchecked: `core.convert` checks it, so that a
    wrong choice gives the same message from a flag, --set and YAML."""
    if get_origin(tp) in (Union, types.UnionType):
        return _parser(next(a for a in get_args(tp) if a is not type(None)))
    return {"parser": str} if get_origin(tp) is Literal else {}


def command(cls: type, handler: Handler) -> Callable[..., None]:
    """A function Typer reads as a command with the options of `cls`, then --config and --set;
    it calls `handler` with the options given."""
    options = parameters(cls)
    listed = [parameter for _, parameter in options]
    listed += [_parameter("config", ConfigFile, None), _parameter("sets", Sets, None)]
    assert len({p.name for p in listed}) == len(listed), f"{cls.__name__}: two options share a name"

    def run_command(**given: Any) -> None:
        values: dict[str, Any] = {}
        for path, parameter in options:
            if given[parameter.name] is not None:
                group = values
                for part in path[:-1]:
                    group = group.setdefault(part, {})
                group[path[-1]] = given[parameter.name]
        handler(values, given["config"], given["sets"])

    run_command.__signature__ = inspect.Signature(listed)  # type: ignore[attr-defined]
    run_command.__annotations__ = {p.name: p.annotation for p in listed} | {"return": None}
    return run_command
