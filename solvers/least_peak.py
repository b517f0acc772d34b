"""The floor: the smallest peak any plan reaches, with the plan that reaches it.

`least_peak_plan(problem)` depends on the problem's graph and on the options only, never
on `problem.budget_bytes` (it searches at budget 0) nor on the machine's load (every
limit is deterministic work), so its answer is a budget that plans: at exactly that
budget the floor plan fits, and a solver warm-started with it (`hint`) returns it or a
cheaper one. The search: the `all` plan (recompute everything), the offload-everything
plans when offload is allowed, then `auto` at budget 0 (brute when tiny, dp's exact
least peak on block sequences, else ilp's smallest-peak search, all warm-started with
the best of those), the least peak wins, ties to the cheaper; then a descent from it
(`descend`: one decision changed at a time while that lowers the peak), which finds
what ilp's search misses where its min-peak model under-counts a recomputation run.
"""

from __future__ import annotations

import time

from remat_solvers.base import WorkClock, finish
from remat_solvers.problem import Decision, Phase, Plan, Problem, decisions_all
from remat_solvers.registry import SOLVERS, UnsupportedProblem, solve
from remat_solvers.segmented import checkpoint_decisions, layer_segments, per_reader_segments, segmented_schedule
from remat_solvers.simulate import PlanError, evaluate

FLOOR_TIME_LIMIT_S = 10.0
"""Deterministic seconds the floor search may spend (the ilp default)."""
DESCENT_SHARE = 0.2
"""The descent's limit, as a share of the floor search's: simulated steps at
`base.WORK_STEPS_PER_S`. On the random block compositions of `bench/floor_search.py`
(20-213 decision values) the floor search with it took at most 0.8 CPU s more than
ilp's search alone."""


def least_peak_plan(problem: Problem, *, time_limit_s: float | None = FLOOR_TIME_LIMIT_S,
                    seed: int = 0, descend_floor: bool = True) -> Plan:
    """The smallest-peak plan found (ties: the cheaper), as a Plan evaluated at a budget
    equal to its own peak (so its status is FEASIBLE: it fits; no claim that no plan
    peaks lower, though brute and dp do find the exact least peak). Deterministic: the
    same problem graph and options give the same plan. `descend_floor=False`: the plan
    the search found, without the descent (inductor's closed loop tries both: a descent
    that lowers the peak op by op can raise it as inductor generates the code)."""
    started = time.perf_counter()
    zero = problem.with_budget(0)
    candidates = [decisions_all(zero, Decision.RECOMPUTE), decisions_all(zero, Decision.SAVE)]
    if zero.offload_bandwidth_bytes_per_s is not None:
        candidates += _offload_everything(zero)
    best = min(candidates, key=lambda d: _key(zero, d))
    if "auto" in SOLVERS:
        options = {"time_limit_s": time_limit_s, "seed": seed}
        if "ilp" in SOLVERS:
            options["hint"] = best
        try:
            found = solve(zero, "auto", **options)
        except UnsupportedProblem:
            found = None
        if found is not None and _key(zero, found.decisions) <= _key(zero, best):
            best = dict(found.decisions)
    if descend_floor:
        limit_s = None if time_limit_s is None else DESCENT_SHARE * time_limit_s
        best = descend(zero, best, WorkClock(limit_s))
    floor = evaluate(zero, best).peak_bytes
    return finish(problem.with_budget(floor), best, "floor", started_s=started)


def descend(problem: Problem, decisions, clock: WorkClock) -> dict[int, Decision]:
    """`decisions` with one value's decision changed at a time (values in id order, each
    to every other decision it allows) wherever that lowers (peak, cost), passes repeated
    until one changes nothing or `clock` runs out (each simulation charged by its steps).
    Deterministic; never returns a plan that peaks higher. ilp's smallest-peak model is
    exact at node steps only, so the plan it stops at can be one change away from a
    lower peak inside a recomputation run: on `bench/floor_search.py`'s compositions the
    descent lowers ilp's floor by up to 7.2% (bench/README.md, "The floor search")."""
    best = dict(decisions)
    ev = evaluate(problem, best)
    clock.charge_steps(len(ev.steps))
    key = (ev.peak_bytes, ev.cost_s)
    changed = True
    while changed and not clock.expired:
        changed = False
        for i in problem.decision_ids:
            for decision in problem.allowed(i):
                if decision is best[i] or clock.expired:
                    continue
                trial = {**best, i: decision}
                try:
                    ev = evaluate(problem, trial)
                except PlanError:  # a value dropped (not recomputable) that backward needs
                    continue
                clock.charge_steps(len(ev.steps))
                if (ev.peak_bytes, ev.cost_s) < key:
                    best, key, changed = trial, (ev.peak_bytes, ev.cost_s), True
    return best


def peak_lower_bound(problem: Problem) -> int:
    """Bytes live at the last step of every plan, canonical or scheduled: the parameters
    and inputs, and the storage of every output (each lives to the end of the step, so
    at the last step some instance of it is live; one storage counted once). A budget
    below it fits no plan: nothing needs solving to refuse it (LLaMA-7B at fp32: the
    weights and their gradients alone are 50 GiB)."""
    nodes, root = problem.nodes, problem.storage_of
    fixed = (Phase.PARAM, Phase.INPUT)
    initial = sum(node.out_bytes for node in nodes if node.phase in fixed)
    outputs = {root[i] for i in problem.outputs if nodes[root[i]].phase not in fixed}
    return initial + sum(nodes[s].out_bytes for s in outputs)


def scheduled_plans(problem: Problem, best) -> list[Plan]:
    """Plans that recompute some value more than once (solvers/segmented.py), for when
    no canonical plan fits: `best` (if it offloads nothing) and everything recomputed,
    each per layer and per backward reader, and per-layer checkpointing; each evaluated
    at `problem`'s budget, in that order. None on problems without repeated layers.
    They never offload: the rewriter runs a twice-recomputed value without reloads.
    Per-reader segments replay everything before every reader: least peak, most cost."""
    if problem.layers is None:
        return []
    started = time.perf_counter()
    layers, readers = layer_segments(problem), per_reader_segments(problem)
    bases = [dict(best)] if Decision.OFFLOAD not in dict(best).values() else []
    bases.append(decisions_all(problem, Decision.RECOMPUTE))
    tries = [(d, segments) for d in bases for segments in (layers, readers)]
    tries.append((checkpoint_decisions(problem), layers))
    plans = []
    for decisions, segments in tries:
        try:
            schedule = segmented_schedule(problem, decisions, segments)
            plans.append(finish(problem, decisions, "scheduled", started_s=started, schedule=schedule))
        except PlanError:
            continue
    return plans


def _key(problem: Problem, decisions) -> tuple[int, float]:
    ev = evaluate(problem, decisions)
    return ev.peak_bytes, ev.cost_s


def _offload_everything(problem: Problem) -> list[dict[int, Decision]]:
    """Every offloadable value offloaded, the rest recomputed where it can be (or all
    saved): the plans `remat.frontend.offloading.offload_floor_bytes` bounds with."""
    out = []
    for rest in (Decision.RECOMPUTE, Decision.SAVE):
        decisions = {}
        for i in problem.decision_ids:
            if Decision.OFFLOAD in problem.allowed(i):
                decisions[i] = Decision.OFFLOAD
            elif rest is Decision.RECOMPUTE and problem.nodes[i].recomputable:
                decisions[i] = Decision.RECOMPUTE
            else:
                decisions[i] = Decision.SAVE
        out.append(decisions)
    return out
