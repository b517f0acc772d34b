"""One saved value per storage: a plan never hands the backward two saved tensors that
share one forward storage (a value and a view of it, or two views of one value).

The runtime needs it. AOTAutograd marks a saved tensor as a donated buffer when its
storage is not one of the forward's inputs or outputs or the backward's outputs, one
saved tensor at a time, and inductor's backward then reuses a donated buffer in place
once that tensor's last reader has run. With a value and its view both saved, the
value's buffer is overwritten after the value's last reader while the view, the same
bytes, is still to be read: the backward reads garbage and the gradient is silently
wrong (a LayerNorm output and its reshape for the next Linear: the Linear's weight
gradient).

`one_save_per_storage` saves the storage's own value instead and recomputes the views
from it in the backward. The peak does not move: the saved views held that storage
alive anyway, views allocate nothing, and a view costs no compute. The eager runtime
does not donate, but the rewrite is the same for both, and a view recomputed from the
same bytes is the same tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from remat_solvers.base import finish
from remat_solvers.problem import Decision, Phase, Plan, Problem, Status, Step, StepKind
from remat_solvers.simulate import evaluate


def shared_saves(problem: Problem, plan: Plan, steps: Sequence[Step] | None = None) -> dict[int, list[int]]:
    """Per forward storage (the id of the value that owns it): the saved values the
    backward reads in it, where there are two or more. Empty for a plan the runtime can
    run as it is; an INFEASIBLE plan is not looked at. `steps`: the plan's simulated steps
    when the caller has them (else simulated here, only when two saved values share a
    storage at all)."""
    if plan.status is Status.INFEASIBLE:
        return {}
    groups: dict[int, list[int]] = {}
    for i, d in plan.decisions.items():
        root = problem.storage_of[i]
        if d is Decision.SAVE and problem.nodes[root].phase is Phase.FORWARD:
            groups.setdefault(root, []).append(i)
    if all(len(ids) < 2 for ids in groups.values()):
        return {}
    if steps is None:
        steps = evaluate(problem, plan.decisions, plan.schedule).steps
    read = read_in_backward(problem, steps)
    groups = {root: [i for i in ids if i in read] for root, ids in groups.items()}
    return {root: sorted(ids) for root, ids in groups.items() if len(ids) > 1}


def read_in_backward(problem: Problem, steps: Sequence[Step]) -> set[int]:
    """Ids read by some backward or recompute step of `steps` (a reload reads the host
    copy, not the value's inputs)."""
    nodes = problem.nodes
    return {j for step in steps if step.kind in (StepKind.BACKWARD, StepKind.RECOMPUTE)
            for j in nodes[step.node_id].inputs}


def one_save_per_storage(problem: Problem, plan: Plan) -> Plan:
    """`plan` with every storage that two saved values share saved once, as the value that
    owns it, and every saved view in it recomputed (just before its first reader in an
    explicit schedule, with the views it is a view of that are not on the device there;
    the owner's own recomputes leave the schedule: it is saved now).
    Returns `plan` itself when no storage is shared, or when a view in one reads another
    forward value (recomputing it would hold that value too; ATen's views read only their
    base): the rewrite then refuses the plan (`shared_saves`)."""
    groups = shared_saves(problem, plan)
    views = sorted(i for i, d in plan.decisions.items()
                   if d is Decision.SAVE and problem.storage_of[i] in groups and i not in groups)
    if not views or not all(_from_its_base(problem, i) for i in views):
        return plan
    decisions = dict(plan.decisions)
    for root in groups:
        decisions[root] = Decision.SAVE
    for i in views:
        decisions[i] = Decision.RECOMPUTE
    schedule = None
    if plan.schedule is not None:  # a root saved now is read from its save, never recomputed
        kept = [j for j in plan.schedule if j not in groups]
        schedule = _with_recomputes(problem, kept, views, decisions)
    # judged against the plan's own peak: a plan may be run above the problem's budget
    # (the ledger's first step runs the lowest peak found), and this one peaks no higher
    out = finish(problem.with_budget(plan.peak_bytes), decisions, plan.solver, started_s=0.0,
                 schedule=schedule, work_s=plan.work_s, lower_bound_s=plan.lower_bound_s)
    # still optimal when it costs no more (a saved root may carry a save cost the views did not)
    optimal = plan.status is Status.OPTIMAL and out.status is Status.FEASIBLE and out.objective_s <= plan.objective_s
    return dataclasses.replace(out, solve_s=plan.solve_s, status=Status.OPTIMAL if optimal else out.status)


def _from_its_base(problem: Problem, i: int) -> bool:
    """Whether view i recomputes from its base alone (its other inputs live all step)."""
    node = problem.nodes[i]
    return node.recomputable and all(
        j == node.alias_of or problem.nodes[j].phase in (Phase.PARAM, Phase.INPUT) for j in node.inputs)


def _with_recomputes(problem: Problem, schedule: Sequence[int], views: Sequence[int],
                     decisions: dict[int, Decision]) -> list[int]:
    """`schedule` with each of `views` that a step reads recomputed just before the first
    such step, after whatever of its chain of bases is not on the device there yet: a
    view of a view that the schedule recomputes later (a split's chunk saved, the
    reshape it was split from recomputed for another reader) is recomputed with it, and
    not again where the schedule recomputed it (a view of a saved value stays valid)."""
    nodes = problem.nodes
    wanted = set(views)
    available = {i for i, d in decisions.items() if d is Decision.SAVE}
    out: list[int] = []
    brought: set[int] = set()

    def bring(i: int) -> None:
        for j in nodes[i].inputs:
            if j not in available and decisions.get(j) is Decision.RECOMPUTE and nodes[j].alias_of is not None:
                bring(j)  # a view costs nothing: recomputed where it is needed, once
        out.append(i)
        available.add(i)
        brought.add(i)

    for j in schedule:
        if j in brought:
            continue
        for i in nodes[j].inputs:
            if i in wanted and i not in available:
                bring(i)
        out.append(j)
        if nodes[j].phase is Phase.FORWARD:
            available.add(j)
    return out
