"""Backward schedules that recompute a value more than once (`Plan.schedule`).

The canonical schedule (solvers/simulate.py) recomputes a dropped value at most once,
just before its first backward reader, and holds it to its last. A segmented schedule
splits backward into segments: a value recomputed in one segment is dropped at the
segment's end (simulate frees each instance after its last reader; a later read binds
to a newer instance) and recomputed again if a later segment reads it. Per-layer
checkpointing (`checkpoint`) is the segmented schedule whose segments are the layers'
backward, with every layer's input saved and everything inside a layer recomputed:
keep each layer's inputs, replay the layer just before its backward, free it after.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from remat_solvers.base import Options, finish
from remat_solvers.layer_structure import OUTSIDE
from remat_solvers.problem import Decision, Phase, Plan, Problem, Step
from remat_solvers.registry import UnsupportedProblem
from remat_solvers.simulate import _bring_back


def segmented_schedule(problem: Problem, decisions: Mapping[int, Decision],
                       segment_of: Sequence[int | None]) -> tuple[int, ...]:
    """Backward ids in order, each preceded by the recomputations (and reloads) of the
    forward values it reads that are not on the device. `segment_of[b]` names backward
    node b's segment (None: the current one); when it changes, every value recomputed
    so far is dropped (a later reader recomputes it)."""
    nodes = problem.nodes
    saved = {i for i, d in decisions.items() if d is Decision.SAVE}
    available = set(saved)
    schedule: list[int] = []
    current = None
    for b in problem.backward_ids:
        seg = segment_of[b]
        if seg is not None and seg != current:
            if current is not None:
                available = saved | {i for i in available if decisions.get(i) is Decision.OFFLOAD}
            current = seg
        for j in nodes[b].inputs:
            if nodes[j].phase is Phase.FORWARD and j not in available:
                steps: list[Step] = []  # simulate's own bring-back (PlanError if j cannot come back)
                _bring_back(problem, decisions, j, available, steps, reader=b)
                schedule.extend(step.node_id for step in steps)
        schedule.append(b)
    return tuple(schedule)


def per_reader_segments(problem: Problem) -> list[int | None]:
    """Every backward node its own segment: each reader recomputes what it needs afresh
    (the most recomputation; the least held between readers). Except a node that reads
    a backward node reading all its forward inputs: it shares that node's segment. The
    other outputs of a multi-output op are such nodes (solvers read them as reading the
    op's inputs, which the op's run has already used: recomputing those inputs again
    for them would only lengthen lifetimes the model holds and the runtime does not)."""
    nodes = problem.nodes
    segment: list[int | None] = list(range(len(nodes)))
    for b in problem.backward_ids:
        mine = {j for j in nodes[b].inputs if nodes[j].phase is Phase.FORWARD}
        for c in reversed(nodes[b].inputs):
            if nodes[c].phase is Phase.BACKWARD and mine <= set(nodes[c].inputs):
                segment[b] = segment[c]
                break
    return segment


def layer_segments(problem: Problem) -> list[int | None]:
    """Per node: for a backward node, the deepest layer among the forward values it reads
    (its segment: backward runs the layers last to first); None for the rest."""
    layers = problem.layers
    if layers is None:
        raise UnsupportedProblem("checkpoint: the problem has no repeated layers (Problem.layers)")
    nodes = problem.nodes
    out: list[int | None] = [None] * len(nodes)
    for b in problem.backward_ids:
        deepest = max((layers.layer_of[j] for j in nodes[b].inputs if nodes[j].phase is Phase.FORWARD),
                      default=OUTSIDE)
        out[b] = deepest if deepest != OUTSIDE else None
    return out


def checkpoint_decisions(problem: Problem) -> dict[int, Decision]:
    """Per-layer checkpointing: save what a layer's nodes read from outside it (its
    inputs) and every value outside the layers; recompute the rest of each layer."""
    layer_of = problem.layers.layer_of
    nodes = problem.nodes
    crosses: set[int] = set()
    for i, node in enumerate(nodes):
        if node.phase is not Phase.FORWARD:
            continue
        for j in node.inputs:
            if layer_of[j] != layer_of[i]:
                crosses.add(j)
    decisions = {}
    for i in problem.decision_ids:
        keep = layer_of[i] == OUTSIDE or i in crosses or not nodes[i].recomputable
        decisions[i] = Decision.SAVE if keep else Decision.RECOMPUTE
    return decisions


def solve_checkpoint(problem: Problem, options: Options) -> Plan:
    """`checkpoint`: per-layer checkpointing as a plan (declines without layers)."""
    started = time.perf_counter()
    segments = layer_segments(problem)
    decisions = checkpoint_decisions(problem)
    return finish(problem, decisions, "checkpoint", started_s=started,
                  schedule=segmented_schedule(problem, decisions, segments))
