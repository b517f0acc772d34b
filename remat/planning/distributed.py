"""remat under torch.distributed: one plan on every rank, and the compositions that work.

Collectives are never replayed: the profile marks every c10d / functional-collective /
DTensor op never-replay (`frontend.profile.never_replay_reason`), so a backward that
needs one's value reads the saved value, and each rank runs exactly the collectives of
the unplanned step. Why the plan must still agree across ranks: costs are measured per
process (device speed, load) and solvers stop on time limits, so two ranks can solve
the same graph to different plans, or one rank to none (it raises while its peers wait
in their next collective: a hang). And a promise that differs per rank is no promise
about the step. So when a process group of more than one rank is up, every rank takes
rank 0's plan (as torch's `_sync_decision_cross_ranks` does for its min-cut), after
checking that all ranks planned the same graph. The plans travel through the process
group's store, never as a collective (see `_exchange`).

What composes in torch 2.13 (measured on CPU gloo, 2 ranks):
- `DDP(remat.plan(model, ...))`: the planned module's parameters are the model's own,
  so DDP's gradient hooks and buckets fire as for the plain model.
- `torch.compile(model, backend=remat.backend(...))` over a DDP or FSDP2 model: dynamo
  splits the step into graphs (DDPOptimizer per bucket, FSDP2 at every sharded module)
  and remat plans each graph.
- `remat.plan` over a model already `fully_shard`-ed cannot work: AOTAutograd traces
  `functional_call` with fake tensors, and FSDP2's pre-forward hook resets its sharded
  parameters by reading their data pointers ("Attempted to access the data pointer on
  an invalid python storage"); its all-gathers run in hooks outside any graph.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import pickle
from typing import Any

import torch
from torch import nn

from remat.errors import CompositionError
from remat_solvers import Plan, Problem

log = logging.getLogger(__name__)


def world_size() -> int:
    """Ranks in the default process group (1 when none is initialized)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def check_plannable(model: nn.Module) -> None:
    """Refuse, before tracing, a model that `remat.plan` cannot trace: one sharded by
    FSDP2 (`fully_shard`) or FSDP1, naming the composition that works."""
    for name, module in model.named_modules():
        kind = _sharded_kind(module)
        if kind is None:
            continue
        where = f"module {name!r}" if name else "the model itself"
        raise CompositionError(
            f"{where} ({type(module).__name__}) is sharded by {kind}; remat.plan traces the "
            "model with fake tensors, and the sharded parameters' pre-forward hooks cannot "
            "run there. Plan the sharded model through torch.compile instead: "
            "torch.compile(model, backend=remat.backend(budget=...)), which plans every "
            "graph between FSDP's all-gathers (see remat.planning.distributed)"
        )


def _sharded_kind(module: nn.Module) -> str | None:
    # imported on use, not with remat: a torch built without distributed cannot import it
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return "FSDP2 (fully_shard)"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch builds without FSDP1
        return None
    return "FSDP (FullyShardedDataParallel)" if isinstance(module, FullyShardedDataParallel) else None


def problem_fingerprint(problem: Problem) -> str:
    """What must be equal for one rank's plan to be valid on another: the graph and its
    bytes, not the per-process measured seconds."""
    rows = tuple(
        (n.name, n.inputs, n.out_bytes, n.alias_of, n.phase.name, n.recomputable, n.offloadable)
        for n in problem.nodes
    )
    text = repr((rows, problem.outputs, problem.budget_bytes))
    return hashlib.sha256(text.encode()).hexdigest()


def agree_on_plan(problem: Problem, plan: Plan) -> Plan:
    """Rank 0's plan, on every rank of the default process group.

    Raises `CompositionError` on every rank alike when the ranks planned different
    graphs or budgets (different shapes per rank, a rank-dependent branch): no plan is
    then valid everywhere."""
    dist = torch.distributed
    gathered = _exchange((problem_fingerprint(problem), _plan_fields(plan)))
    fingerprints = [fp for fp, _ in gathered]
    if len(set(fingerprints)) != 1:
        differ = [r for r, fp in enumerate(fingerprints) if fp != fingerprints[0]]
        raise CompositionError(
            f"ranks {differ} traced a different joint graph or budget than rank 0, so one plan "
            "cannot serve every rank; give every rank the same input shapes, dtypes and budget "
            "when planning"
        )
    chosen = Plan(**gathered[0][1])
    if chosen != plan or chosen.decisions != plan.decisions:
        log.info("remat: rank %d takes rank 0's plan (%s)", dist.get_rank(), chosen.solver)
    return chosen


_EXCHANGES = itertools.count()
"""Exchanges made by this process; every rank plans the same graphs in the same order,
so the n-th exchange of every rank is about the same graph (the fingerprint checks it)."""


def _exchange(mine: Any) -> list[Any]:
    """Every rank's `mine`, through the process group's key-value store, not through a
    collective. The plan is exchanged while the partitioner runs inside a compile, and
    that compile can sit between the collectives of the step (FSDP2's all-gathers,
    DDP's buckets, their async work in flight): a collective there would have to match
    every rank's collective sequence exactly. A store key cannot be mismatched with a
    collective, and a rank that never publishes makes its peers fail with the store's
    timeout instead of hanging."""
    from remat.compat import get_default_store  # on use: only a process group of several ranks needs it

    dist = torch.distributed
    store = get_default_store()
    key = f"remat/plan/{next(_EXCHANGES)}"
    store.set(f"{key}/{dist.get_rank()}", pickle.dumps(mine))
    try:
        return [pickle.loads(store.get(f"{key}/{rank}")) for rank in range(dist.get_world_size())]
    except RuntimeError as e:  # DistStoreError: a rank did not publish in time
        raise CompositionError(
            f"rank {dist.get_rank()} waited for the other ranks' plans ({key}) past the "
            f"process group's timeout ({e}); every rank must compile the same graphs in "
            "the same order"
        ) from e


def _plan_fields(plan: Plan) -> dict[str, Any]:
    """The plan as plain picklable values (its decisions are a read-only mapping)."""
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    fields["decisions"] = dict(plan.decisions)
    return fields


__all__ = [
    "CompositionError",
    "agree_on_plan",
    "check_plannable",
    "problem_fingerprint",
    "world_size",
]
