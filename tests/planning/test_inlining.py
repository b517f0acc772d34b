"""The joint graph as inductor's lowering runs it (`remat.planning.inlining`): a pointwise
value with one pointwise or reduction reader holds no bytes, its inputs live until that
reader, and a value a plan may save for the backward keeps its bytes.

The graph is AOTAutograd's joint graph of a log-softmax under inductor's decompositions
(as `remat.backend` gets it), squared and summed. The backward's
`(g - exp(out) * sum(g)) * 2` inlines `exp` into `mul`, `mul` into `sub` and `sub` into
the last `mul` (`g` itself has two readers and stays), as does the pow's backward
`pow(out, 1.0) * 2.0` into the product with the tangent; the forward's `pow` has one
reader, `sum`. The forward's `exp` also has one reader, `sum`, but it feeds the output
the backward reads, so a plan may keep it: it stays."""

from __future__ import annotations

import dataclasses

import torch

from remat.frontend.problem import build_problem
from remat.planning.inlining import at_their_readers, inlined_ids, inlined_problem
from remat_solvers import Decision, Node, Phase, Plan, Problem, Status, decisions_all, evaluate, simulate


def _log_softmax_joint():
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition
    from torch._inductor.decomposition import select_decomp_table

    captured = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured["joint"], captured["num_fwd_outputs"] = joint, num_fwd_outputs
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def boxed(gm, _):
        return make_boxed_func(gm)

    fn = aot_function(lambda x: torch.log_softmax(x * 2.0, -1).pow(2).sum(), fw_compiler=boxed, bw_compiler=boxed,
                      partition_fn=partition, decompositions=select_decomp_table())
    fn(torch.randn(8, 32, requires_grad=True)).backward()
    joint = captured["joint"]
    gp = build_problem(joint, num_fwd_outputs=captured["num_fwd_outputs"], num_params=0, budget_bytes=0,
                       cost_s=lambda _: 0.0)
    return joint, gp


def _by_target(joint, gp, ids):
    by_name = {n.name: n for n in joint.graph.nodes}
    return sorted((gp.problem.nodes[i].phase.value, str(by_name[gp.value_name[i]].target)) for i in ids)


def test_single_reader_pointwise_values_of_the_backward_are_inlined_and_a_value_a_plan_may_save_is_not():
    joint, gp = _log_softmax_joint()
    inlined = inlined_ids(gp, joint)
    assert _by_target(joint, gp, inlined) == [
        ("backward", "aten.exp.default"), ("backward", "aten.mul.Scalar"), ("backward", "aten.mul.Tensor"),
        ("backward", "aten.pow.Tensor_Scalar"), ("backward", "aten.sub.Tensor"), ("forward", "aten.pow.Tensor_Scalar")]
    problem = gp.problem
    exps = [i for i, name in enumerate(gp.value_name) if name.startswith("exp")]
    forward_exp = [i for i in exps if problem.nodes[i].phase is Phase.FORWARD]
    assert forward_exp and not set(forward_exp) & inlined  # read by log only, but a plan may save it
    assert set(forward_exp) <= set(problem.decision_ids)


def test_an_inlined_value_holds_no_bytes_and_its_inputs_live_until_its_reader():
    joint, gp = _log_softmax_joint()
    inlined = inlined_ids(gp, joint)
    planned = inlined_problem(gp, joint).problem
    users = gp.problem.users
    for i in inlined:
        assert gp.problem.nodes[i].out_bytes > 0 and planned.nodes[i].out_bytes == 0
        (reader,) = users[i]
        # the reader's kernel reads what the inlined value read (through a chain of them)
        sources = {j for j in gp.problem.nodes[i].inputs if j not in inlined}
        assert sources <= set(planned.nodes[reader].inputs)
    for i, (plain, node) in enumerate(zip(gp.problem.nodes, planned.nodes)):
        assert set(plain.inputs) <= set(node.inputs) and (i in inlined or node.out_bytes == plain.out_bytes)
    # every plan of one is a plan of the other, over the same decisions
    assert planned.decision_ids == gp.problem.decision_ids
    # at `exp(out) * sum(g)`, op by op holds exp(out) and the product; lowered, neither,
    # but `out` (which only exp read) lives until then: one tensor less
    save_all = decisions_all(planned, Decision.SAVE)
    live = [dict(zip((planned.nodes[s.node_id].name for s in ev.steps), ev.timeline))
            for ev in (simulate(gp.problem, save_all), simulate(planned, save_all))]
    (exp,) = [i for i in inlined if gp.value_name[i].startswith("exp")]
    (product,) = [gp.value_name[j] for j in users[exp]]
    assert live[1][product] == live[0][product] - gp.problem.nodes[exp].out_bytes


def test_a_scheduled_inlined_op_runs_at_its_reader_and_reads_the_copy_planned_for_it():
    """A hand-made inlined problem: `a` (100 B) is recomputed twice in the backward; `p`,
    inlined into `q` (0 B), reads `a`, and so does `q` for it (`inlined_problem`). The
    solver's schedule runs `p` on the first copy, then `h`, then `q` on a second copy:
    but `p` runs inside `q`'s kernel, so that first copy would live across `h`. Moved to
    just before `q`, `p` reads the second copy, and the first, left unread, is dropped.

    id  name  phase  bytes  reads
    0   x     input   10
    1   a     fwd    100    x           (recomputed: compute 1.0)
    2   d     fwd      4    a           (the loss, an output)
    3   t     bwd      4    -           (its tangent)
    4   p     bwd      0    t, a        (inlined into q)
    5   h     bwd    100    t
    6   q     bwd    100    p, h, a     (an output; `a` for p)
    """
    F, B = Phase.FORWARD, Phase.BACKWARD
    problem = Problem(
        nodes=(Node(name="x", inputs=(), out_bytes=10, phase=Phase.INPUT),
               Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
               Node(name="d", inputs=(1,), out_bytes=4, phase=F),
               Node(name="t", inputs=(), out_bytes=4, phase=B),
               Node(name="p", inputs=(3, 1), out_bytes=0, phase=B),
               Node(name="h", inputs=(3,), out_bytes=100, phase=B),
               Node(name="q", inputs=(4, 5, 1), out_bytes=100, phase=B)),
        outputs=(2, 6), budget_bytes=10_000)
    schedule = (3, 1, 4, 5, 1, 6)
    ev = evaluate(problem, {1: Decision.RECOMPUTE}, schedule)
    plan = Plan(decisions={1: Decision.RECOMPUTE}, status=Status.FEASIBLE, solver="hand", objective_s=ev.cost_s,
                peak_bytes=ev.peak_bytes, schedule=schedule)
    moved = at_their_readers(problem, plan, {4})
    assert moved.schedule == (3, 5, 1, 4, 6)
    assert moved.objective_s == 1.0 < plan.objective_s == 2.0  # one recompute of `a`, not two
    assert moved.peak_bytes == evaluate(problem, moved.decisions, moved.schedule).peak_bytes <= plan.peak_bytes
    assert at_their_readers(problem, moved, {4}) is moved  # nothing left to move
    assert at_their_readers(problem, dataclasses.replace(plan, schedule=None), {4}).schedule is None
