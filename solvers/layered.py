"""`layers`: exact DP over a stack of repeated layers (Problem.layers), on per-block
Pareto fronts (Rotor / Checkmate style), for traced joint graphs that `dp` refuses.

Plan space: simulate's canonical space, with the values that the layer structure marks
as shared between layers (a causal mask, rotary tables: `LayerStructure.shared_values`)
and the forward outputs kept (SAVE). Everything else is decided exactly, block by block,
by dp's machinery (dp_structure / dp_local / dp_fronts): the shared values are what
keeps a traced stack from splitting into blocks, and keeping them costs a few KiB.

Traced graphs have two more features dp's block model does not describe: the loss is a
forward output, and backward reads activations through views (`t`, `transpose`,
`detach`). The solver plans a *reduced* problem (`fold_views`): each pure view of a
forward storage is folded into its readers (they read the base; a view owns no bytes and
keeps exactly its base's storage alive; a forward view takes its base's decision), and
the kept values are held to the end of the step. The plan is then simulated on the
original problem (the one memory model). Certificate: the reduced model's cost equals
simulate's and its peak is at most the kept bytes above simulate's, so the DP's optimum
at the budget raised by the kept bytes is a lower bound (lower_bound_s) on every plan of
this space that fits; the plan is OPTIMAL when it meets that bound. If simulate disagrees
with the DP on the chosen plan (cost, or a higher peak), no bound is claimed and a
warning is logged. The fold assumes a backward view runs just before its reader, as the
front end emits it; the per-plan check is what guards that assumption.

Without a layer structure the solver raises UnsupportedProblem (auto moves on).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from solvers import dp_fronts as fronts
from solvers.base import WorkClock, finish
from solvers.dp import DPOptions, _cheapest, block_tables
from solvers.dp_structure import analyze
from solvers.problem import Decision, Phase, Plan, Problem
from solvers.registry import UnsupportedProblem
from solvers.simulate import evaluate

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayersOptions(DPOptions):
    """Options of `layers` (those of `dp`): time_limit_s (deterministic seconds) bounds
    building the block tables; past it the solver declines with UnsupportedProblem."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reduced:
    """A problem with its backward views of forward storages folded into their readers."""

    problem: Problem
    to_reduced: dict[int, int]
    """Original id -> reduced id, for every node that stays."""
    base_of: dict[int, int]
    """Folded view -> the original id of the base it stands for."""

    def reduced_id(self, i: int) -> int:
        """The reduced node standing for original node i (a folded view: its base)."""
        return self.to_reduced[self.base_of.get(i, i)]


def fold_views(problem: Problem, kept: frozenset[int] = frozenset()) -> Reduced:
    """Drop each node that is a pure view (reads only its base) of a forward storage; its
    readers read the base instead (chains collapse), and a forward view's decision is its
    base's. `kept` values become outputs of the reduced problem: held to the end of the
    step, at most their bytes more than simulate holds them (a kept mask is read by
    recomputations in backward after its last static read)."""
    nodes, root = problem.nodes, problem.storage_of
    forward = set(problem.forward_ids)
    base_of: dict[int, int] = {}
    keep: list[int] = []
    for i, node in enumerate(nodes):
        if node.alias_of is not None and root[i] in forward and node.inputs == (node.alias_of,):
            base_of[i] = base_of.get(node.alias_of, node.alias_of)
        else:
            keep.append(i)
    new_id = {old: k for k, old in enumerate(keep)}

    def mapped(j: int) -> int:
        return new_id[base_of.get(j, j)]

    out = []
    for old in keep:
        node = nodes[old]
        alias = None if node.alias_of is None else mapped(node.alias_of)
        out.append(dataclasses.replace(node, inputs=tuple(dict.fromkeys(mapped(j) for j in node.inputs)),
                                       alias_of=alias))
    outputs = dict.fromkeys(mapped(j) for j in (*problem.outputs, *sorted(kept)))
    reduced = Problem(nodes=tuple(out), outputs=tuple(outputs), budget_bytes=problem.budget_bytes,
                      offload_bandwidth_bytes_per_s=problem.offload_bandwidth_bytes_per_s)
    return Reduced(problem=reduced, to_reduced=new_id, base_of=base_of)


def kept_values(problem: Problem) -> frozenset[int]:
    """Decision values this plan space keeps: shared between layers, on an output's
    storage (an output lives to the end of the step anyway), or views of a parameter or
    input (their storage is live all step and a view costs nothing to recompute)."""
    root, nodes = problem.storage_of, problem.nodes
    out_roots = {root[j] for j in problem.outputs}
    free = {v for v in problem.decision_ids
            if root[v] in out_roots or nodes[root[v]].phase in (Phase.PARAM, Phase.INPUT)}
    return problem.layers.shared_values(problem) | frozenset(free)


def _behind(problem: Problem, kept: frozenset[int]) -> frozenset[int]:
    """`kept` plus the decision values needed only to recompute kept values (a mask's
    ancestors): with the kept values saved, nothing ever recomputes them, so they are
    saved too (held to their last forward read, as a value no decision changes)."""
    nodes = problem.nodes
    needed = set(problem.needed_ids) - kept
    for i in reversed(problem.forward_ids):
        if i in needed:
            needed.update(j for j in nodes[i].inputs if nodes[j].phase is Phase.FORWARD and j not in kept)
    return frozenset(v for v in problem.decision_ids if v not in needed)


def solve_layers(problem: Problem, options: DPOptions) -> Plan:
    started = time.perf_counter()
    if problem.layers is None or problem.layers.n_layers < 2:
        raise UnsupportedProblem("layers: the problem carries no layer structure (Problem.layers, found by "
                                 "the torch front end from nn_module_stack); use 'dp' or 'ilp'")
    if not problem.decision_ids:
        return finish(problem, {}, "layers", started_s=started, optimal=True, lower_bound_s=0.0)
    limit = getattr(options, "max_block_configs", DPOptions().max_block_configs)
    clock = WorkClock(options.time_limit_s)
    kept = kept_values(problem)
    red = fold_views(problem, kept)
    fixed = _behind(red.problem, frozenset(red.reduced_id(v) for v in kept))
    try:
        seq = analyze(red.problem, fixed=fixed)
        tables = block_tables(red.problem, seq, limit, clock, fixed)
    except UnsupportedProblem as error:
        raise UnsupportedProblem(f"layers (on dp's block machinery): {error}", work_s=clock.spent_s) from None
    budget = problem.budget_bytes
    found = _cheapest(tables, seq.initial_bytes, budget)
    if found is None:  # nothing fits: the least peak, then the cheapest plan at that peak
        least = fronts.run(tables, seq.initial_bytes, budget, min_peak=True)
        found = fronts.run(tables, seq.initial_bytes, least[2], min_peak=False) or least
    configs, cost, peak = found
    chosen: dict[int, Decision] = {}
    for block, config in zip(seq.blocks, configs):
        chosen.update(zip(block.values, config))
    decisions = {i: _unfolded(problem, i, chosen.get(red.reduced_id(i), Decision.SAVE))
                 for i in problem.decision_ids}
    ev = evaluate(problem, decisions)
    bound = _bound(problem, tables, seq.initial_bytes, kept, ev.cost_s, ev.peak_bytes, (cost, peak))
    return finish(problem, decisions, "layers", started_s=started,
                  optimal=bound is not None and bound >= ev.cost_s * (1 - 1e-9), lower_bound_s=bound,
                  work_s=clock.spent_s)


def _unfolded(problem: Problem, i: int, base_decision: Decision) -> Decision:
    """A folded view takes its base's decision, except OFFLOAD (a view is never moved on
    its own): the view of an offloaded base is recomputed from the reloaded base."""
    if base_decision is Decision.OFFLOAD and Decision.OFFLOAD not in problem.allowed(i):
        return Decision.RECOMPUTE if problem.nodes[i].recomputable else Decision.SAVE
    return base_decision


def _bound(problem: Problem, tables: list, initial_bytes: int, kept: frozenset[int], cost_s: float,
           peak_bytes: int, predicted: tuple[float, int]) -> float | None:
    """A lower bound on the cost of every plan of this space that simulate fits in the
    budget: the DP's optimum with the budget raised by the kept bytes (the reduced model
    holds kept values at most that much longer than simulate). None when the plan does
    not fit or simulate disagrees with the DP's cost (then the model is not trusted)."""
    cost, peak = predicted
    if peak_bytes > problem.budget_bytes:
        return None
    if not math.isclose(cost_s, cost, rel_tol=1e-9, abs_tol=1e-12) or peak_bytes > peak:
        log.warning("layers: predicted cost %.6g / peak %d but simulate gives %.6g / %d; no bound",
                    cost, peak, cost_s, peak_bytes)
        return None
    slack = sum(problem.nodes[v].out_bytes for v in kept if problem.storage_of[v] == v
                and problem.nodes[v].phase is Phase.FORWARD)
    relaxed = _cheapest(tables, initial_bytes, problem.budget_bytes + slack)
    return cost_s if relaxed is None else min(cost_s, relaxed[1])
