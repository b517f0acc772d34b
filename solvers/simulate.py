"""The one memory/compute model: run a plan's schedule and account every live byte.

Canonical schedule (used when a plan has no explicit one):
  1. PARAM/INPUT values are live for the whole step.
  2. Forward nodes run in order.
  3. Backward nodes run in order. Before each, every forward value it reads that is not
     on the device is brought back just in time: OFFLOAD values are reloaded, RECOMPUTE
     values are recomputed after (recursively) their own missing forward inputs, in
     input order. A value brought back in backward stays until its last use, so the
     canonical schedule recomputes each value at most once.
  4. Every value is freed right after its last use (a step that reads it), except the
     problem's outputs, which live to the end. A value nobody reads is freed right after
     the step that makes it. An alias keeps its base's storage alive; bytes are counted
     once per storage.
  5. An op's workspace (Node.workspace_bytes) is live only while its step runs: it
     adds to that step's timeline entry (forward, backward or recompute; not a reload).
  6. SAVE values keep their forward instance for backward; RECOMPUTE and OFFLOAD values
     lose it after their last forward use (OFFLOAD moves it to host memory: the copy out
     overlaps the forward compute after that use and costs only what sticks out,
     `Problem.store_s`; the copy back is waited for in full, `Problem.reload_s`).

An explicit schedule (Plan.schedule) replaces step 3: backward ids once each in any
order their inputs allow, forward ids wherever they are recomputed (RECOMPUTE) or
reloaded (OFFLOAD), as often as wanted; a read binds to the newest instance. A reload
scheduled early (prefetched, solvers/prefetch.py) holds its bytes from its step on, and
its copy overlaps the backward steps between it and its first reader
(`_exposed_reload_s`); written out in canonical order, it prices as the canonical one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from remat_solvers.problem import Decision, Evaluation, Phase, Plan, Problem, Step, StepKind


class PlanError(ValueError):
    """The plan is malformed or its schedule cannot run; the message names the step."""


def simulate(problem: Problem, plan: Plan | Mapping[int, Decision]) -> Evaluation:
    """Peak bytes, extra seconds and the timeline of `plan` on `problem`."""
    if isinstance(plan, Plan):
        return evaluate(problem, plan.decisions, plan.schedule)
    return evaluate(problem, plan)


def evaluate(
    problem: Problem,
    decisions: Mapping[int, Decision],
    schedule: Sequence[int] | None = None,
) -> Evaluation:
    """`simulate` on raw decisions (what solvers call in their inner loops)."""
    _check_decisions(problem, decisions)
    steps = [Step(i, StepKind.FORWARD) for i in problem.forward_ids]
    if schedule is None:
        steps += _canonical_backward(problem, decisions)
    else:
        steps += _explicit_backward(problem, decisions, schedule)
    life = _lifetimes(problem, decisions, steps, explicit=schedule is not None)
    timeline, peak, peak_step = _live_bytes(problem, steps, life)
    bw = problem.offload_bandwidth_bytes_per_s
    return Evaluation(
        peak_bytes=peak,
        peak_step=peak_step,
        recompute_s=life.recompute_s,
        offload_bytes=life.offload_bytes,
        offload_s=life.offload_s,
        steps=tuple(steps),
        timeline=tuple(timeline),
        fits=peak <= problem.budget_bytes,
        recomputed_ids=tuple(sorted(life.recomputed)),
        transfer_s=life.transfer_bytes / bw if bw else 0.0,
        save_s=_save_s(problem, decisions),
    )


def _check_decisions(problem: Problem, decisions: Mapping[int, Decision]) -> None:
    expected = problem.decision_ids
    if len(decisions) != len(expected) or any(i not in decisions for i in expected):
        missing = sorted(set(expected) - set(decisions))[:5]
        extra = sorted(set(decisions) - set(expected))[:5]
        raise PlanError(
            "a plan must decide exactly problem.decision_ids; "
            f"missing {missing}{'...' if len(missing) == 5 else ''}, "
            f"not decision values {extra}{'...' if len(extra) == 5 else ''}"
        )
    for i, d in decisions.items():
        if d not in problem.allowed(i):
            why = (
                "offload is disabled (offload_bandwidth_bytes_per_s is None)"
                if problem.offload_bandwidth_bytes_per_s is None
                else "the node is not offloadable"
            )
            raise PlanError(f"node {i} ({problem.nodes[i].name!r}): {d.value} not allowed: {why}")


def _canonical_backward(problem: Problem, decisions: Mapping[int, Decision]) -> list[Step]:
    nodes = problem.nodes
    on_device = {i for i, d in decisions.items() if d is Decision.SAVE}
    steps: list[Step] = []
    for b in problem.backward_ids:
        for j in nodes[b].inputs:
            if nodes[j].phase is Phase.FORWARD and j not in on_device:
                _bring_back(problem, decisions, j, on_device, steps, reader=b)
        steps.append(Step(b, StepKind.BACKWARD))
    return steps


def _bring_back(
    problem: Problem,
    decisions: Mapping[int, Decision],
    root: int,
    on_device: set[int],
    steps: list[Step],
    reader: int,
) -> None:
    """Append the reload/recompute steps that make `root` live (iterative post-order)."""
    nodes = problem.nodes
    stack: list[tuple[int, bool]] = [(root, False)]
    while stack:
        i, expanded = stack.pop()
        if i in on_device:
            continue
        d = decisions.get(i)
        if d is None:  # a forward value no backward value depends on: cannot happen
            raise PlanError(f"node {i} ({nodes[i].name!r}) is needed in backward but has no decision")
        if d is Decision.OFFLOAD:
            steps.append(Step(i, StepKind.RELOAD))
            on_device.add(i)
            continue
        if not nodes[i].recomputable:
            raise PlanError(
                f"node {i} ({nodes[i].name!r}) is not recomputable but the plan drops it and "
                f"backward node {reader} ({nodes[reader].name!r}) needs it: SAVE or OFFLOAD it"
            )
        if expanded:
            steps.append(Step(i, StepKind.RECOMPUTE))
            on_device.add(i)
            continue
        stack.append((i, True))
        for j in reversed(nodes[i].inputs):
            if nodes[j].phase is Phase.FORWARD and j not in on_device:
                stack.append((j, False))


def _explicit_backward(
    problem: Problem, decisions: Mapping[int, Decision], schedule: Sequence[int]
) -> list[Step]:
    nodes = problem.nodes
    n = len(nodes)
    available = {i for i, d in decisions.items() if d is Decision.SAVE}
    done_backward: set[int] = set()
    steps: list[Step] = []
    for pos, i in enumerate(schedule):
        where = f"schedule[{pos}] = {i}"
        if not isinstance(i, int) or not 0 <= i < n:
            raise PlanError(f"{where}: not a node id (0..{n - 1})")
        node = nodes[i]
        if node.phase in (Phase.PARAM, Phase.INPUT):
            raise PlanError(f"{where} ({node.name!r}): {node.phase.value} values are never scheduled")
        if node.phase is Phase.BACKWARD and i in done_backward:
            raise PlanError(f"{where} ({node.name!r}): backward node scheduled twice")
        kind = StepKind.BACKWARD
        if node.phase is Phase.FORWARD:
            d = decisions.get(i)
            if d is None or d is Decision.SAVE:
                raise PlanError(f"{where} ({node.name!r}): only RECOMPUTE or OFFLOAD values can be scheduled")
            kind = StepKind.RELOAD if d is Decision.OFFLOAD else StepKind.RECOMPUTE
            if kind is StepKind.RECOMPUTE and not node.recomputable:
                raise PlanError(f"{where} ({node.name!r}): node is not recomputable")
        if kind is not StepKind.RELOAD:
            for j in node.inputs:
                if nodes[j].phase is Phase.FORWARD and j not in available:
                    raise PlanError(
                        f"{where} ({node.name!r}) reads node {j} ({nodes[j].name!r}), "
                        "which is not on the device at that point"
                    )
                if nodes[j].phase is Phase.BACKWARD and j not in done_backward:
                    raise PlanError(
                        f"{where} ({node.name!r}) reads backward node {j} ({nodes[j].name!r}) before it runs"
                    )
        if node.phase is Phase.BACKWARD:
            done_backward.add(i)
        else:
            available.add(i)
        steps.append(Step(i, kind))
    missing = [i for i in problem.backward_ids if i not in done_backward]
    if missing:
        raise PlanError(f"schedule never runs backward nodes {missing[:5]}")
    return steps


def _exposed_reload_s(problem: Problem, steps: Sequence[Step]) -> float:
    """Seconds the backward waits for reloads under an explicit schedule.

    The copies run one after another over the link in schedule order, each from when it
    is issued or the link frees up; the first step that reads a reloaded value waits for
    its copy. The clock the copies hide behind advances by the BACKWARD steps only:
    recompute steps are not counted (an under-count, so the price is an upper bound),
    which makes the canonical order, where only recomputes sit between a reload and its
    reader, price exactly as `Problem.reload_s` (each copy waited for in full)."""
    nodes = problem.nodes
    clock = link_free = waited = 0.0
    pending: dict[int, float] = {}  # reloaded node -> when its copy is done
    for step in steps:
        i = step.node_id
        if step.kind is StepKind.FORWARD:
            continue
        if step.kind is StepKind.RELOAD:
            link_free = max(clock, link_free) + problem.transfer_s(i)
            pending[i] = link_free
            continue
        ready = max((pending.pop(j) for j in nodes[i].inputs if j in pending), default=clock)
        if ready > clock:
            waited += ready - clock
            clock = ready
        if step.kind is StepKind.BACKWARD:
            clock += nodes[i].compute_s
    return waited


class _Lifetimes(NamedTuple):
    """What one pass over the steps finds: each storage's bytes and the steps it is live
    for, and the costs the steps add up to."""

    initial_bytes: int
    """PARAM/INPUT bytes, live before step 0 and to the end."""
    storage_bytes: dict[int, int]
    """Storage (the instance that allocated it) -> bytes."""
    storage_start: dict[int, int]
    """Storage -> the step that allocates it."""
    storage_end: dict[int, int]
    """Storage -> the last step that reads any instance on it (`n_steps`: never freed)."""
    recompute_s: float
    """Seconds of the RECOMPUTE steps."""
    recomputed: set[int]
    """Ids recomputed at least once."""
    offload_bytes: int
    """Bytes copied out in forward (OFFLOAD values)."""
    offload_s: float
    """Seconds the step waits for copies: what sticks out of the copies out, plus the
    reloads (each in full, or as `_exposed_reload_s` prices an explicit schedule)."""
    transfer_bytes: int
    """Bytes over the link both ways."""


def _lifetimes(problem: Problem, decisions: Mapping[int, Decision], steps: list[Step],
               *, explicit: bool = False) -> _Lifetimes:
    """Bind every read to the newest instance of the value it reads, find each storage's
    first and last step, and total the recompute and transfer costs of the steps (the
    same pass: both walk the steps in order)."""
    nodes = problem.nodes
    forever = len(steps)  # past the last step: never freed
    newest: dict[int, int] = {}  # node id -> instance id of its newest materialization
    inst_storage: list[int] = []  # instance -> storage instance
    inst_end: list[int] = []  # instance -> last step that reads it
    storage_bytes: dict[int, int] = {}  # storage instance -> bytes
    storage_start: dict[int, int] = {}

    # PARAM/INPUT instances exist before step 0 and live forever.
    initial_bytes = 0
    for i, node in enumerate(nodes):
        if node.phase in (Phase.PARAM, Phase.INPUT):
            newest[i] = len(inst_storage)
            inst_storage.append(len(inst_storage))
            inst_end.append(forever)
            initial_bytes += node.out_bytes

    offload_bytes = 0
    transfer_bytes = 0
    offload_s = 0.0
    recompute_s = 0.0
    recomputed: set[int] = set()
    for k, step in enumerate(steps):
        i = step.node_id
        node = nodes[i]
        if step.kind is StepKind.RELOAD:
            transfer_bytes += node.out_bytes
            if not explicit:
                offload_s += problem.reload_s(i)
        else:
            for j in node.inputs:
                inst = newest[j]
                if inst_end[inst] < k:
                    inst_end[inst] = k
        inst = len(inst_storage)
        if step.kind is StepKind.RECOMPUTE:
            recompute_s += node.compute_s
            recomputed.add(i)
        if node.alias_of is not None and step.kind is not StepKind.RELOAD:
            inst_storage.append(inst_storage[newest[node.alias_of]])
        else:
            inst_storage.append(inst)
            storage_bytes[inst] = node.out_bytes
            storage_start[inst] = k
        inst_end.append(k)
        newest[i] = inst
        if step.kind is StepKind.FORWARD and decisions.get(i) is Decision.OFFLOAD:
            offload_bytes += node.out_bytes
            offload_s += problem.store_s(i)
    transfer_bytes += offload_bytes
    if explicit:
        offload_s += _exposed_reload_s(problem, steps)
    for i in problem.outputs:
        inst_end[newest[i]] = forever

    storage_end: dict[int, int] = {}
    for inst, s in enumerate(inst_storage):
        if s in storage_start and inst_end[inst] > storage_end.get(s, -1):
            storage_end[s] = inst_end[inst]
    return _Lifetimes(initial_bytes, storage_bytes, storage_start, storage_end, recompute_s, recomputed,
                      offload_bytes, offload_s, transfer_bytes)


def _live_bytes(problem: Problem, steps: list[Step], life: _Lifetimes) -> tuple[list[int], int, int]:
    """Sweep the storages' lifetimes into the live bytes at each step: (timeline, peak
    bytes, peak step; -1 when nothing rises above the initial bytes). A step's entry
    counts what it allocates, what is still live, and its op's workspace (not a reload's)."""
    nodes = problem.nodes
    n_steps = len(steps)
    alloc_at = [0] * n_steps
    free_after = [0] * (n_steps + 1)
    for s, start in life.storage_start.items():
        alloc_at[start] += life.storage_bytes[s]
        free_after[life.storage_end[s]] += life.storage_bytes[s]

    live = life.initial_bytes
    peak, peak_step = live, -1
    timeline = []
    for k in range(n_steps):
        live += alloc_at[k]
        step = steps[k]
        now = live if step.kind is StepKind.RELOAD else live + nodes[step.node_id].workspace_bytes
        timeline.append(now)
        if now > peak:
            peak, peak_step = now, k
        live -= free_after[k]
    return timeline, peak, peak_step


def _save_s(problem: Problem, decisions: Mapping[int, Decision]) -> float:
    """`Node.save_s` of the saved values that are charged for it (`Problem.save_charged`)."""
    return sum(s for i, s in problem.save_charged if decisions.get(i) is Decision.SAVE)
