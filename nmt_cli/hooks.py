"""Named points where a test reaches into a real run: a process killed in the middle of a save, a
fault injected into an update, the examples each worker trained on.

`at(point, **details)` returns None at once in every real run. With NMT_TEST_HOOKS set to a Python
file (the test suite sets it to tests/fault_hooks.py for every process it starts), that file is loaded
once in each process and its function named `point`, if it has one, is called with the details;
what it returns is returned (a replacement value, where the point takes one). The points:

- ``worker_started(rank)``: a training process has set up;
- ``forward_done(attempt, micro, rank, loss)``: a training micro-batch's forward; may raise
  torch.OutOfMemoryError or return another loss;
- ``backward_done(attempt, micro, rank)``: its backward; may raise torch.OutOfMemoryError;
- ``gradients_reduced(attempt, rank, model)``: after the gradient all-reduce of an update;
- ``examples_trained(rank, epoch, update, ids)``: the examples of a micro-batch that was trained;
- ``file_written(path)``: a checkpoint or model file's temporary file is written, not yet renamed;
- ``checkpoint_saved(path)``: a numbered checkpoint is in place, checkpoint_last.pt not yet.

A training checkpoint's ``file_written`` and ``checkpoint_saved`` run in the thread that writes it
(`training.checkpoint.Saver`) while training goes on; what they raise, the training thread raises
at its next save or at the end of the run.

`attempt` counts every update tried, skipped ones too, from 1 (0: the dry run's largest-batch
trial); `micro` counts the micro-batches of an update from 1.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_loaded: dict[str, ModuleType] = {}


def at(point: str, **details: Any) -> Any:
    path = os.environ.get("NMT_TEST_HOOKS")
    if not path:
        return None
    module = _loaded.get(path)
    if module is None:
        spec = importlib.util.spec_from_file_location("nmt_test_hooks", path)
        assert spec is not None and spec.loader is not None, f"NMT_TEST_HOOKS: cannot load {path}"
        module = _loaded[path] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    hook = getattr(module, point, None)
    return None if hook is None else hook(**details)
