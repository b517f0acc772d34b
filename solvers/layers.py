"""`layers`: exact DP over a stack of repeated layers (Problem.layers), on per-block
Pareto fronts (Rotor / Checkmate style), for traced joint graphs that `dp` refuses.

Plan space: simulate's canonical space, with these values kept (SAVE): those the layer
structure marks as shared between layers (a causal mask, rotary tables:
`LayerStructure.shared_values`), those on a forward output's storage, views of
parameters (`kept_values`), and the values needed only to recompute kept ones; and with
each pure forward view decided as its base. Everything else is decided exactly, block by
block, by dp's machinery (solvers/dp/: structure, local, fronts): the shared values are
what keeps a traced stack from splitting into blocks, and keeping them costs a few KiB.

Traced graphs have two more features dp's block model does not describe: the loss is a
forward output, and backward reads activations through views (`t`, `transpose`,
`detach`). The solver plans a *reduced* problem (`fold_views`): each pure view of a
forward storage is folded into its readers (they read the base; a view owns no bytes and
keeps exactly its base's storage alive; a forward view takes its base's decision).

A kept value (a mask) stays live in simulate until its last read, which may be a
recomputation in backward; dp's static bytes cannot see that. So the DP runs on two
models of the reduced problem: an optimistic one (kept values die at their last static
read: never above simulate's peak, so its optimum is a lower bound on every plan of this
space that fits) and a conservative one (kept values live to the end of the step: never
below simulate's peak, so its plans fit). The optimistic optimum is returned OPTIMAL when
simulate says it fits; else the conservative optimum, with the optimistic cost as
lower_bound_s (OPTIMAL when they meet). Every plan is simulated on the original problem
(the one memory model); if simulate's cost differs from the DP's, no bound is claimed and
a warning is logged. The fold assumes a backward view runs just before its reader, as
the front end emits it; the per-plan check is what guards that assumption.

Save costs (`Node.save_s`) are charged as in dp; the kept values are SAVE in every plan
of the space, so their save seconds are a constant added to both models' costs.

Without a layer structure the solver raises UnsupportedProblem (auto moves on).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from remat_solvers.base import WorkClock, finish
from remat_solvers.dp import fronts
from remat_solvers.dp.solver import DPOptions, _cheapest
from remat_solvers.dp.structure import analyze
from remat_solvers.dp.tables import block_tables
from remat_solvers.problem import Decision, Phase, Plan, Problem
from remat_solvers.registry import UnsupportedProblem
from remat_solvers.simulate import evaluate

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayersOptions(DPOptions):
    """Options of `layers` (those of `dp`): time_limit_s (deterministic seconds) bounds
    building the block tables; past it the solver declines with UnsupportedProblem."""

    max_block_configs: int = 1 << 17
    """Largest block enumerated (dp's default is 2^14). Traced transformers with dropout
    replay have attention blocks of 57,600 (GPT-2) and 95,040 (LLaMA) configurations
    after dp's exact pruning (of which dp's exact skips leave 11,208 and 24,960 to
    replay): one pass over such a block (layer 0's table comes with the others',
    dp/tables.py) takes a few CPU s cold on one core, once per process (and then on
    disk) for every depth and budget (bench/README.md, "The tables' clock"). `auto`
    passes AutoOptions.layers_max_block_configs (the same 2^17)."""

    least_peak: bool = True
    """When no plan of the space fits the budget: search the space's least peak and
    return it INFEASIBLE (True), or decline with UnsupportedProblem (False). `auto`
    passes False: it drops an infeasible `layers` plan (its least peak is over the
    narrower space) and moves on, and on a deep stack that search is the costliest part
    of the solve (LLaMA-7B's 32 layers: minutes and gigabytes of fronts)."""


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
    # Two models of the same reduced graph (the same ids): kept values die at their last
    # static read (optimistic: never above simulate, so its optimum is a lower bound) or
    # live to the end (conservative: never below simulate, so its plans fit).
    # The optimistic model counts a kept value only until the phase (F_b or G_b) of its
    # last read begins (even fewer bytes, so still a lower bound): the last layer
    # reading a causal mask then shares the other layers' table (GPT-2: one
    # 57,600-configuration table less to build), and LLaMA's layer 0, where rotary
    # tables read in every backward die, shares the conservative model's table.
    # Both models' tables are charged before any answer, so the limit decides on the
    # space as a whole; only a refusal (nothing fits, no least peak asked for) skips
    # the conservative model.
    optimistic = _Model(problem, fold_views(problem, frozenset()), kept, limit, clock, True)
    budget = problem.budget_bytes
    low = optimistic.cheapest(budget)
    if low is None and not getattr(options, "least_peak", True):  # the lower bound does not fit
        raise UnsupportedProblem(f"layers: no plan of its space fits {budget} bytes", work_s=clock.spent_s)
    conservative = _Model(problem, fold_views(problem, kept), kept, limit, clock, False)
    if low is not None:
        decisions, cost = optimistic.decisions(low)
        ev = evaluate(problem, decisions)
        if not math.isclose(ev.cost_s, cost, rel_tol=1e-9, abs_tol=1e-12):
            log.warning("layers: predicted cost %.6g but simulate gives %.6g; no bound", cost, ev.cost_s)
            low = None
        elif ev.fits:  # the relaxation's optimum fits: optimal outright
            return finish(problem, decisions, "layers", started_s=started, optimal=True,
                          lower_bound_s=ev.cost_s, work_s=clock.spent_s)
    found = conservative.cheapest(budget)
    if found is None and not getattr(options, "least_peak", True):
        raise UnsupportedProblem(f"layers: no plan of its space fits {budget} bytes", work_s=clock.spent_s)
    if found is None:  # nothing fits: the least peak, then the cheapest plan at that peak
        found = conservative.least_peak(budget)
    decisions, cost = conservative.decisions(found)
    ev = evaluate(problem, decisions)
    bound = None
    if low is not None and ev.fits and math.isclose(ev.cost_s, cost, rel_tol=1e-9, abs_tol=1e-12):
        bound = min(low[1], ev.cost_s)
    return finish(problem, decisions, "layers", started_s=started,
                  optimal=bound is not None and bound >= ev.cost_s * (1 - 1e-9), lower_bound_s=bound,
                  work_s=clock.spent_s)


class _Model:
    """dp's block tables for one reduced problem."""

    def __init__(self, problem: Problem, red: Reduced, kept: frozenset[int], limit: int,
                 clock: WorkClock, release_early: bool = False) -> None:
        self.problem, self.red = problem, red
        kept_red = frozenset(red.reduced_id(v) for v in kept)
        fixed = _behind(red.problem, kept_red)
        early = frozenset(red.problem.storage_of[v] for v in kept_red) if release_early else frozenset()
        # kept values are SAVE in every plan of the space: what saving them costs
        # (Node.save_s; views carry none, so the reduced problem charges as the original)
        # is a constant of the space, added to every cost the tables give
        self.fixed_s = sum(s for v, s in red.problem.save_charged if v in fixed)
        try:
            self.seq = analyze(red.problem, fixed=fixed, release_early=early)
            self.tables = block_tables(red.problem, self.seq, limit, clock, fixed)
        except UnsupportedProblem as error:
            raise UnsupportedProblem(f"layers (on dp's block machinery): {error}",
                                     work_s=clock.spent_s) from None

    def cheapest(self, budget: int) -> tuple | None:
        return self._charged(_cheapest(self.tables, self.seq.initial_bytes, budget))

    def least_peak(self, budget: int) -> tuple:
        least = fronts.run(self.tables, self.seq.initial_bytes, budget, min_peak=True)
        return self._charged(fronts.run(self.tables, self.seq.initial_bytes, least[2], min_peak=False) or least)

    def _charged(self, found: tuple | None) -> tuple | None:
        """(configs, cost, peak) with the kept values' save seconds added to the cost."""
        if found is None or not self.fixed_s:
            return found
        configs, cost, peak = found
        return configs, cost + self.fixed_s, peak

    def decisions(self, found: tuple) -> tuple[dict[int, Decision], float]:
        """The plan of the original problem and the DP's cost for it."""
        configs, cost, _ = found
        chosen: dict[int, Decision] = {}
        for block, config in zip(self.seq.blocks, configs):
            chosen.update(zip(block.values, config))
        red = self.red
        return {i: _unfolded(self.problem, i, chosen.get(red.reduced_id(i), Decision.SAVE))
                for i in self.problem.decision_ids}, cost


def _unfolded(problem: Problem, i: int, base_decision: Decision) -> Decision:
    """A folded view takes its base's decision, except OFFLOAD (a view is never moved on
    its own): the view of an offloaded base is recomputed from the reloaded base."""
    if base_decision is Decision.OFFLOAD and Decision.OFFLOAD not in problem.allowed(i):
        return Decision.RECOMPUTE if problem.nodes[i].recomputable else Decision.SAVE
    return base_decision
