"""How the whole step's budget is split among the graph calls of a step.

Inputs, from the first step (`runtime.step.ledger`): per call, the bytes measured live
outside it when it started (`outside_bytes`), which earlier calls were still waiting for
their backward then (`pending`), and what each call's plan held across its forward and
backward (`held_bytes`, measured: its autograd node's saved tensors). What is outside a
call and not held by a pending call is static: it does not depend on any plan
(parameters, gradients, the batch, tensors eager code keeps).

Each graph gets a menu of plans, solved (not compiled) at budgets from its floor up to
its no-remat peak. A plan's held bytes, relative to the one measured, move with its
predicted live bytes between forward and backward (`boundary_bytes`: the same
parameters, inputs and outputs, a different set of saved activations). The split is
then a choice per call such that at every call j

    static_j + sum(held_i for the pending calls i before j) + peak_j <= budget,

the least total recompute. When the plans the first step ran already fit, they stay
(no compile; under inductor the partitioner's plans are tuned for fusion in ways the
solver's cost does not see). Otherwise, greedy: every call starts at its floor (if that does not fit,
nothing does: the smallest reachable whole-step peak is reported), then the upgrade that
saves the most recompute time and keeps every call under the budget is taken, until
none is left. Calls of one graph (FSDP2's layer graph, run once per layer) may get
different plans: the deeper call has more held before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from remat_solvers import Decision, Plan, Problem, Status, decisions_all, simulate, solve

MENU_POINTS = 6
"""Budgets tried per graph between its floor and its no-remat peak (plus both ends)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One plan a graph could run: what to plan it with, and what it would cost."""

    budget_bytes: int
    peak_bytes: int
    boundary_bytes: int
    cost_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallRecord:
    """What the ledger measured for one call of the first step."""

    graph: int
    outside_bytes: int
    pending: tuple[int, ...]
    """Positions of the earlier calls still waiting for their backward."""
    held_bytes: int
    boundary_bytes: int
    """`boundary_bytes` of the plan it ran."""


def boundary_bytes(problem: Problem, plan: Plan | Mapping[int, Decision]) -> int:
    """Predicted live bytes between the forward and the backward of `plan`."""
    forward_steps = len(problem.forward_ids)
    timeline = simulate(problem, plan).timeline
    return timeline[forward_steps - 1] if forward_steps and timeline else 0


def menu(problem: Problem, *, baseline_bytes: int, floor: Plan, solver: str,
         options: Mapping[str, Any], planned: Sequence[tuple[int, Plan]] = ()) -> tuple[Option, ...]:
    """Plans of one graph from its floor to its no-remat peak, ascending by peak, each
    strictly cheaper than the one before (a plan that peaks higher for no less
    recompute is never worth choosing). `planned`: (budget, plan) of the plans the graph
    already has, which join the menu (reusing one costs no compile)."""
    found = [_option(problem, floor, floor.peak_bytes), save_all_option(problem, baseline_bytes)]
    found += [_option(problem, plan, budget) for budget, plan in planned]
    span = baseline_bytes - floor.peak_bytes
    for k in range(1, MENU_POINTS):
        budget = floor.peak_bytes + span * k // MENU_POINTS
        plan = solve(problem.with_budget(budget), solver, **options)
        if plan.status is not Status.INFEASIBLE:
            found.append(_option(problem, plan, budget))
    return frontier(found)


def frontier(options: Sequence[Option]) -> tuple[Option, ...]:
    """`options` ascending by peak, each strictly cheaper than the one before."""
    out: list[Option] = []
    for option in sorted(options, key=lambda o: (o.peak_bytes, o.cost_s)):
        if not out or option.cost_s < out[-1].cost_s:
            out.append(option)
    return tuple(out)


def save_all_option(problem: Problem, baseline_bytes: int) -> Option:
    """The no-remat plan as an option."""
    save_all = decisions_all(problem, Decision.SAVE)
    return Option(budget_bytes=baseline_bytes, peak_bytes=baseline_bytes,
                  boundary_bytes=boundary_bytes(problem, save_all), cost_s=0.0)


def _option(problem: Problem, plan: Plan, budget: int) -> Option:
    evaluation = simulate(problem, plan)
    return Option(budget_bytes=budget, peak_bytes=evaluation.peak_bytes,
                  boundary_bytes=boundary_bytes(problem, plan), cost_s=evaluation.cost_s)


def step_peaks(calls: Sequence[CallRecord], options: Sequence[Option]) -> list[int]:
    """Predicted live bytes at the peak of each call, when each runs its option."""
    held = [c.held_bytes + o.boundary_bytes - c.boundary_bytes for c, o in zip(calls, options)]
    peaks = []
    for c, o in zip(calls, options):
        static = c.outside_bytes - sum(calls[i].held_bytes for i in c.pending)
        peaks.append(static + sum(held[i] for i in c.pending) + o.peak_bytes)
    return peaks


def allocate(calls: Sequence[CallRecord], menus: Mapping[int, Sequence[Option]],
             budget_bytes: int) -> tuple[tuple[Option, ...] | None, int]:
    """The option per call (None when even every floor exceeds the budget), and the
    predicted whole-step peak of that choice (of the floors when None)."""
    choice = [0] * len(calls)

    def options(ks: Sequence[int]) -> list[Option]:
        return [menus[c.graph][k] for c, k in zip(calls, ks)]

    peak = max(step_peaks(calls, options(choice)), default=0)
    if peak > budget_bytes:
        return None, peak
    while True:
        best = None
        for i, c in enumerate(calls):
            k = choice[i] + 1
            if k >= len(menus[c.graph]):
                continue
            trial = choice[:i] + [k] + choice[i + 1:]
            trial_peak = max(step_peaks(calls, options(trial)))
            saved_s = menus[c.graph][choice[i]].cost_s - menus[c.graph][k].cost_s
            if trial_peak <= budget_bytes and (best is None or saved_s > best[0]):
                best = (saved_s, trial, trial_peak)
        if best is None:
            return tuple(options(choice)), peak
        _, choice, peak = best


def no_remat_step_bytes(calls: Sequence[CallRecord], save_all: Mapping[int, Option]) -> int:
    """The whole step's predicted peak when no call rematerializes."""
    return max(step_peaks(calls, [save_all[c.graph] for c in calls]), default=0)
