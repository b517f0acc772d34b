"""Prefetch reloads: the same decisions, with each reload issued early enough that its
copy overlaps backward compute, as far as the budget allows.

The canonical schedule reloads an offloaded value just before its first backward
reader, which then waits for the whole copy (`Problem.reload_s`). Issuing the reload
earlier hides the copy behind the backward steps in between, at the price of holding
the value on the device from the earlier step on. `prefetch` returns the plan with an
explicit schedule (`Plan.schedule`) in which every reload sits at the latest step that
hides it as well as any step allowed under the budget; `simulate` prices it (memory of
the early reload; the link as a queue of copies; see `simulate._exposed_reload_s`).

Per reload, in schedule order (a reload never passes an earlier one, so the link serves
them in the same order), one walk back from its step, without re-simulating:
- moving a reload from step p to step q adds its bytes to the live bytes of the steps
  q..p-1 and to nothing else, so the move fits when max(live[q:p]) + bytes <= budget;
- its copy starts at the clock of step q (or when the link frees up) and its reader
  waits for what is left: the exposed seconds can only shrink as q moves back;
the walk stops at the first step that breaks the budget, at the earlier reload, or once
the copy is hidden, and keeps the latest step with the least exposure. The clock is the
backward compute before each step, without the waits for earlier reloads (exact for one
reload; with several, an estimate that only steers the choice). One `evaluate` of the
result prices it exactly and decides: a schedule that is not better is not returned.
Cost: the steps walked, not a simulation per candidate (a 3200-node chain with 800
offloads took 327 s with per-candidate simulation).
The decisions never change: exact solvers stay exact over their own plan space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from remat_solvers.problem import Decision, Evaluation, Phase, Plan, Problem, Step, StepKind
from remat_solvers.simulate import evaluate


def prefetch(problem: Problem, plan: Plan) -> Plan:
    """`plan` with its reloads issued early (an explicit schedule), when that lowers its
    exposed transfer seconds within `problem.budget_bytes`; otherwise `plan` itself."""
    if problem.offload_bandwidth_bytes_per_s is None or Decision.OFFLOAD not in plan.decisions.values():
        return plan
    before = evaluate(problem, plan.decisions, plan.schedule)
    if not before.fits:
        return plan
    n_forward = len(problem.forward_ids)
    steps = list(before.steps[n_forward:])
    live = list(before.timeline[n_forward:])
    clock = _backward_clock(problem, steps)
    floor, link_free = 0, 0.0
    for p in [k for k, s in enumerate(steps) if s.kind is StepKind.RELOAD]:
        q, link_free = _best_position(problem, steps, live, clock, p, floor, link_free)
        floor = q + 1
        if q == p:
            continue
        nbytes = problem.nodes[steps[p].node_id].out_bytes
        for lst in (steps, clock):
            lst.insert(q, lst.pop(p))
        live.pop(p)
        live.insert(q, live[q] + nbytes)  # an upper bound of the reload step's bytes
        for k in range(q + 1, p + 1):
            live[k] += nbytes
    schedule = [s.node_id for s in steps]
    after = evaluate(problem, plan.decisions, schedule)
    if not after.fits or after.cost_s >= before.cost_s:
        return plan
    return _with_schedule(plan, schedule, after)


def _backward_clock(problem: Problem, steps: Sequence[Step]) -> list[float]:
    """Per backward step: the BACKWARD compute seconds before it (simulate's clock
    without waits, summed in the same order)."""
    out, clock = [], 0.0
    for step in steps:
        out.append(clock)
        if step.kind is StepKind.BACKWARD:
            clock += problem.nodes[step.node_id].compute_s
    return out


def _best_position(problem: Problem, steps: Sequence[Step], live: Sequence[int], clock: Sequence[float],
                   p: int, floor: int, link_free: float) -> tuple[int, float]:
    """(the step to issue the reload at step p from, when its copy is done)."""
    i = steps[p].node_id
    nodes = problem.nodes
    reader = next((k for k in range(p + 1, len(steps))
                   if steps[k].kind is not StepKind.RELOAD and i in nodes[steps[k].node_id].inputs), None)
    if reader is None:
        return p, link_free
    transfer_s, nbytes = problem.transfer_s(i), nodes[i].out_bytes

    def done(q: int) -> float:
        return max(clock[q], link_free) + transfer_s

    best_q, best_wait = p, max(0.0, done(p) - clock[reader])
    highest = 0  # max(live[q:p]) as q walks back
    for q in range(p - 1, floor - 1, -1):
        if best_wait <= 0.0:
            break
        highest = max(highest, live[q])
        if highest + nbytes > problem.budget_bytes:
            break
        wait = max(0.0, done(q) - clock[reader])
        if wait < best_wait:
            best_q, best_wait = q, wait
    return best_q, done(best_q)


def _with_schedule(plan: Plan, schedule: Sequence[int], ev: Evaluation) -> Plan:
    """The plan with `schedule` and the claims simulate makes for it. Status and lower
    bound stay the solver's, over its own plan space (a bound above the new objective
    is dropped: it no longer bounds it)."""
    bound = plan.lower_bound_s
    return dataclasses.replace(
        plan, schedule=tuple(schedule), objective_s=ev.cost_s, peak_bytes=ev.peak_bytes,
        lower_bound_s=bound if bound is None or bound <= ev.cost_s else None,
    )


def prefetched_ids(problem: Problem, ev: Evaluation) -> tuple[int, ...]:
    """Offloaded values whose reload is issued before a BACKWARD step that precedes its
    first reader (i.e. really prefetched), in schedule order."""
    out = []
    steps = ev.steps[len(problem.forward_ids):]
    nodes = problem.nodes
    for k, step in enumerate(steps):
        if step.kind is not StepKind.RELOAD:
            continue
        for later in steps[k + 1:]:
            if later.kind is StepKind.RELOAD:
                continue
            if step.node_id in nodes[later.node_id].inputs:
                break
            if later.kind is StepKind.BACKWARD and nodes[later.node_id].phase is Phase.BACKWARD:
                out.append(step.node_id)
                break
    return tuple(out)


__all__ = ["prefetch", "prefetched_ids"]
