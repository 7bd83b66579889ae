"""Reading a fairseq checkpoint without running its pickle.

A fairseq checkpoint is a `torch.save` zip whose pickle holds, besides tensors and plain containers,
an `argparse.Namespace` (the model settings) and, from some fairseq versions, omegaconf containers.
`torch.load(weights_only=True)` refuses those, and `weights_only=False` would run whatever a hostile
file names. Here the pickle is read by an Unpickler whose only globals are an allow-list: torch's
tensor rebuilders, `collections.OrderedDict`, `argparse.Namespace`, and stand-ins for omegaconf's
classes that keep their state as plain data. Any other global (`os.system`, `builtins.eval`, ...) is
refused before it is called, so loading a hostile file runs nothing.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from nmt_cli.errors import NmtError


class Plain:
    """What an omegaconf object becomes: its pickled state, kept as data; `plain` reads it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Marker:
    """A type named inside omegaconf's metadata (typing.Any, builtins.dict, ...): never called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _omegaconf_class(name: str) -> type:
    return type(name, (Plain,), {})


# (module, name) -> what the pickle gets for it. Nothing here runs code of the file's choosing:
# the torch functions rebuild a tensor from a storage, the classes only hold data.
ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    **{("omegaconf" + module, name): _omegaconf_class(name) for module, name in [
        (".dictconfig", "DictConfig"), (".listconfig", "ListConfig"), (".nodes", "AnyNode"),
        (".nodes", "StringNode"), (".nodes", "IntegerNode"), (".nodes", "FloatNode"),
        (".nodes", "BooleanNode"), (".nodes", "EnumNode"), (".base", "ContainerMetadata"),
        (".base", "Metadata")]},
    **{(module, name): _Marker(f"{module}.{name}") for module, name in [
        ("typing", "Any"), ("builtins", "dict"), ("builtins", "list"), ("builtins", "str"),
        ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "object")]},
}


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only the globals of `ALLOWED`; `torch.load` wraps it (adding its
    storage types and the storages' persistent ids)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        if isinstance(allowed, _Marker):
            return allowed  # a type used as a value; calling it fails in the pickle, as it should
        return allowed


class _PickleModule:
    """What `torch.load(pickle_module=...)` needs of a pickle module."""

    Unpickler = RestrictedUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return RestrictedUnpickler(file, **kwargs).load()


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents with Namespaces and omegaconf objects as plain dicts and lists."""
    if not path.is_file():
        raise NmtError(f"{path} does not exist or is not a file")
    if not zipfile.is_zipfile(path):
        raise NmtError(f"{path} is not a fairseq checkpoint: not the zip archive torch.save writes (fairseq "
                       "checkpoints from before torch 1.6 are legacy pickles: load and re-save them with "
                       "a recent torch in a trusted environment)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule)
    except pickle.UnpicklingError as e:
        raise NmtError(f"{path} was refused and nothing in it was run: its pickle names something other "
                       f"than tensors and settings ({e}). Only import checkpoints you trust.") from None
    except Exception as e:  # a damaged archive fails in many ways: all are damage
        raise NmtError(f"{path} is truncated or corrupt and cannot be read "
                       f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(state, dict):
        raise NmtError(f"{path} is not a fairseq checkpoint (no dictionary of 'model', 'cfg' or 'args')")
    return plain(state)


def plain(value: Any) -> Any:
    """Namespaces, omegaconf containers and their nodes as dicts, lists and scalars; tensors unchanged."""
    if isinstance(value, argparse.Namespace):
        return {k: plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, Plain):
        state = value.state if isinstance(value.state, dict) else {}
        content = state.get("_content", state.get("_val"))
        return plain(content)
    return value
