"""Hypothesis strategies: small random joint problems built by builders.joint_from_forward.

Costs are multiples of 1/8 so sums are exact in floating point; problems have at most
7 forward ops (at most 3**7 = 2187 plans, so brute force stays fast)."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from remat_solvers import Decision, Phase, Problem, decisions_all
from remat_solvers.builders import FwdOp, joint_from_forward
from remat_solvers.simulate import evaluate

COSTS = [0.0, 0.125, 0.5, 1.0, 1.5, 2.0, 3.0, 8.0]


@st.composite
def forward_ops(draw, max_forward: int = 6) -> list[FwdOp]:
    """A random forward description: 1-2 inputs, 0-2 parameters, 1..max_forward ops and a
    loss reading the last op; random bytes, costs, derivative reads, views, and
    non-recomputable / non-offloadable ops."""
    n_inputs = draw(st.integers(1, 2))
    n_params = draw(st.sampled_from([0, 1, 1, 2]))
    # Without a parameter the first input wants a gradient, so backward is never empty.
    ops = [FwdOp(name=f"x{k}", out_bytes=draw(st.integers(0, 64)), phase=Phase.INPUT,
                 requires_grad=n_params == 0 and k == 0 or draw(st.booleans())) for k in range(n_inputs)]
    ops += [FwdOp(name=f"w{k}", out_bytes=draw(st.integers(0, 16)), phase=Phase.PARAM)
            for k in range(n_params)]
    for k in range(draw(st.sampled_from(range(1, max_forward + 1)))):
        v = len(ops)
        # Prefer recent values so chains appear, but allow long skips.
        first = draw(st.integers(max(0, v - 2), v - 1))
        others = draw(st.lists(st.integers(0, v - 1), max_size=2))
        inputs = tuple(dict.fromkeys([first, *others]))
        alias = draw(st.sampled_from([None, None, None, first]))
        ops.append(FwdOp(
            name=f"v{k}",
            out_bytes=ops[first].out_bytes if alias is not None else draw(st.integers(0, 128)),
            inputs=inputs,
            compute_s=draw(st.sampled_from(COSTS)),
            grad_reads=tuple(draw(st.lists(st.sampled_from([*inputs, v]), min_size=draw(st.sampled_from([0, 1, 1])), max_size=3, unique=True))),
            grad_alias=draw(st.booleans()) if alias is not None else False,
            alias_of=alias,
            recomputable=draw(st.integers(0, 6)) > 0,
            offloadable=draw(st.integers(0, 4)) > 0,
        ))
    last = len(ops) - 1
    ops.append(FwdOp(name="loss", out_bytes=draw(st.sampled_from([0, 4])), inputs=(last,),
                     compute_s=draw(st.sampled_from(COSTS)),
                     grad_reads=draw(st.sampled_from([(), (last,)]))))
    return ops


def peaks(problem: Problem) -> tuple[int, int]:
    """(peak of the all-RECOMPUTE plan, peak of the all-SAVE plan)."""
    return (
        evaluate(problem, decisions_all(problem, Decision.RECOMPUTE)).peak_bytes,
        evaluate(problem, decisions_all(problem, Decision.SAVE)).peak_bytes,
    )


WORKSPACES = [0, 0, 0, 8, 40, 160]
"""Op workspace bytes: mostly none, some small, some larger than any value."""


@st.composite
def problems(draw, max_forward: int = 6, offload: bool | None = None,
             workspace: bool | None = None, save: bool = False) -> Problem:
    """A random joint problem with a budget between 80% of the smaller and the larger of
    the `all` and `none` peaks (so some are infeasible); offload bandwidth
    None or a power of two (offload=None: either); op workspaces on forward and
    backward non-view nodes (workspace=None: either); `save`: what saving costs
    (`Node.save_s`) on forward non-view nodes."""
    problem = joint_from_forward(draw(forward_ops(max_forward)))
    if workspace is None:
        workspace = draw(st.booleans())
    if workspace:
        nodes = tuple(
            dataclasses.replace(n, workspace_bytes=draw(st.sampled_from(WORKSPACES)))
            if n.phase in (Phase.FORWARD, Phase.BACKWARD) and n.alias_of is None else n
            for n in problem.nodes)
        problem = dataclasses.replace(problem, nodes=nodes)
    if save:
        nodes = tuple(
            dataclasses.replace(n, save_s=draw(st.sampled_from([0.0, *COSTS])))
            if n.phase is Phase.FORWARD and n.alias_of is None else n
            for n in problem.nodes)
        problem = dataclasses.replace(problem, nodes=nodes)
    if offload is None:
        offload = draw(st.booleans())
    if offload:
        bandwidth = draw(st.sampled_from([16.0, 64.0, 256.0]))
        problem = Problem(nodes=problem.nodes, outputs=problem.outputs, budget_bytes=0,
                          offload_bandwidth_bytes_per_s=bandwidth)
    lo, hi = sorted(peaks(problem))
    # [lo, hi] always fits (none or all does); below lo only a mixed plan may fit.
    return problem.with_budget(draw(st.one_of(st.integers(lo, hi), st.integers(lo * 4 // 5, lo))))
