"""Plans for torch's compile-cache hits: what runs can still be described.

With `remat.backend(cache=True)` a graph whose compiled code comes from torch's FX-graph
or AOTAutograd cache never reaches remat's partitioner: no plan is made in that process.
So every plan remat makes under `cache=True` is also written here, next to torch's own
cache (`torch._inductor.runtime.cache_dir_utils.cache_dir()`, so both are cleared
together), keyed by what torch's key holds for the graph (dynamo's graph code and its
inputs' shapes, strides and dtypes) plus the backend's `uuid()` (everything else the
plan depends on). A hit reads the plan back, and `steps`/`summary` describe it.

A record is a pickle of the `PlannedStep` (its `Plan`'s read-only decisions as a dict).
It is written by this process's remat for this machine's torch cache, the same trust
torch gives its own pickled cache entries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from remat_solvers import Plan

if TYPE_CHECKING:  # the step record is made above the runtime, by the partitioner
    from remat.partitioner import PlannedStep

log = logging.getLogger(__name__)


def _directory() -> Path:
    from remat.compat import inductor_cache_dir  # on use: only cache=True reads inductor's cache

    return Path(inductor_cache_dir()) / "remat_plans"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(map(str, value.shape))}{tuple(map(str, value.stride()))}{value.dtype}{value.device.type}"
    return str(value)


def plan_key(uuid: Sequence[str], gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The key of the plan for graph `gm` compiled by a backend whose uuid is `uuid`."""
    text = "\n".join([repr(tuple(uuid)), gm.code] + [_describe(v) for v in example_inputs])
    return hashlib.sha256(text.encode()).hexdigest()


def store(key: str, step: PlannedStep) -> None:
    """Write `step` under `key` (atomically: a reader never sees half a record)."""
    record = dataclasses.replace(step, plan=None)
    plan = {f.name: getattr(step.plan, f.name) for f in dataclasses.fields(step.plan)}
    plan["decisions"] = dict(step.plan.decisions)
    directory = _directory()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{key}.{os.getpid()}.tmp"
    tmp.write_bytes(pickle.dumps((record, plan)))
    os.replace(tmp, directory / f"{key}.pkl")


def load(key: str) -> PlannedStep | None:
    """The step stored under `key`, or None when there is none (or it cannot be read:
    a record from another remat version is a miss, not an error)."""
    path = _directory() / f"{key}.pkl"
    if not path.exists():
        return None
    try:
        record, plan = pickle.loads(path.read_bytes())
        return dataclasses.replace(record, plan=Plan(**plan))
    except Exception as e:  # unreadable record: describe nothing rather than fail the compile
        log.warning("remat: cannot read the stored plan %s (%s)", path, e)
        return None


__all__ = ["load", "plan_key", "store"]
