"""The problem builders: reverse-mode structure on a hand-derived case, budgets, the
named builders' shapes and speed."""

from __future__ import annotations


import pytest
from hypothesis import given, settings

from remat_solvers import Decision, Phase, Problem, solve
from remat_solvers import builders
from remat_solvers.builders import FwdOp, joint_from_forward
from strategies import forward_ops

F, B, I, P = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT, Phase.PARAM


def _tiny() -> list[FwdOp]:
    """x, w; h = x@w; r = relu(h); y = r@w (w shared); s = y + h (h used twice); loss(s)."""
    return [
        FwdOp(name="x", out_bytes=8, phase=I),
        FwdOp(name="w", out_bytes=4, phase=P),
        FwdOp(name="h", out_bytes=8, inputs=(0, 1), compute_s=1.0, grad_reads=(0, 1)),
        FwdOp(name="r", out_bytes=8, inputs=(2,), compute_s=0.5, grad_reads=(3,)),  # relu reads its output
        FwdOp(name="y", out_bytes=8, inputs=(3, 1), compute_s=1.0, grad_reads=(3, 1)),
        FwdOp(name="s", out_bytes=8, inputs=(4, 2), compute_s=0.25, grad_alias=True),  # add
        FwdOp(name="loss", out_bytes=4, inputs=(5,), compute_s=0.25, grad_reads=(5,)),
    ]


def test_joint_structure_by_hand():
    # Reverse order: loss -> tangent (7); grad_s (8) reads tangent and s.
    # s = y + h: both input grads are views of grad_s (9, 10).
    # y = r@w: grad_r (11) and the first w contribution (12) read grad_y, r, w.
    # r = relu(h): grad_h_from_r (13) reads grad_r and r; h has two contributions (10, 13):
    # accumulated in 14. h = x@w: x wants no grad; the second w contribution (15) reads
    # grad_h, x, w; w's two contributions are accumulated in 16, an output with the loss.
    p = joint_from_forward(_tiny())
    got = [(n.name, n.inputs, n.phase, n.alias_of) for n in p.nodes[7:]]
    assert got == [
        ("tangent_loss", (), B, None),
        ("grad_s_from_loss", (7, 5), B, None),
        ("grad_y_from_s", (8,), B, 8),
        ("grad_h_from_s", (8,), B, 8),
        ("grad_r_from_y", (9, 3, 1), B, None),
        ("grad_w_from_y", (9, 3, 1), B, None),
        ("grad_h_from_r", (11, 3), B, None),
        ("grad_h", (10, 13), B, None),
        ("grad_w_from_h", (14, 0, 1), B, None),
        ("grad_w", (12, 15), B, None),
    ]
    assert p.outputs == (6, 16)
    assert [n.phase for n in p.nodes[:7]] == [I, P, F, F, F, F, F]
    assert p.needed_ids == frozenset({3, 5})
    assert p.decision_ids == (2, 3, 4, 5)
    # Input-gradient nodes cost what their forward op costs.
    assert p.nodes[11].compute_s == 1.0 and p.nodes[13].compute_s == 0.5


def test_input_with_requires_grad_gets_an_output_gradient():
    ops = _tiny()
    ops[0] = FwdOp(name="x", out_bytes=8, phase=I, requires_grad=True)
    p = joint_from_forward(ops)
    assert p.nodes[p.outputs[1]].name == "grad_x_from_h"
    assert p.nodes[p.outputs[2]].name == "grad_w"


def test_non_differentiable_op_stops_gradients():
    # A random mask (no inputs, not recomputable, not differentiable) times x.
    ops = [
        FwdOp(name="x", out_bytes=8, phase=I, requires_grad=True),
        FwdOp(name="mask", out_bytes=2, recomputable=False, differentiable=False),
        FwdOp(name="d", out_bytes=8, inputs=(0, 1), grad_reads=(1,)),
        FwdOp(name="loss", out_bytes=4, inputs=(2,), grad_reads=()),
    ]
    p = joint_from_forward(ops)
    assert [n.name for n in p.nodes[4:]] == ["tangent_loss", "grad_d_from_loss", "grad_x_from_d"]
    assert p.decision_ids == (1,)
    assert solve(p, "all").decisions == {1: Decision.SAVE}  # the mask must be kept


def test_loss_must_be_a_forward_op():
    with pytest.raises(ValueError, match="loss=1 must be the index of a FORWARD op"):
        joint_from_forward(_tiny(), loss=1)


def test_default_budget_is_the_no_remat_peak():
    p = joint_from_forward(_tiny())
    assert p.budget_bytes == solve(p, "none").peak_bytes == builders.no_remat_peak(p)
    assert joint_from_forward(_tiny(), budget_bytes=7).budget_bytes == 7
    half = builders.with_budget_fraction(p, 0.5)
    assert half.budget_bytes == p.budget_bytes // 2 and half.nodes == p.nodes
    with pytest.raises(ValueError, match="fraction must be >= 0"):
        builders.with_budget_fraction(p, -0.5)


def test_offload_bandwidth_keyword():
    assert builders.chain(3).offload_bandwidth_bytes_per_s is None
    p = builders.chain(3, offload_bandwidth_bytes_per_s=1e9)
    assert p.offload_bandwidth_bytes_per_s == 1e9
    assert p.allowed(p.decision_ids[0]) == (Decision.SAVE, Decision.RECOMPUTE, Decision.OFFLOAD)


@settings(max_examples=100)
@given(ops=forward_ops())
def test_random_forward_descriptions_build_valid_problems(ops):
    p = joint_from_forward(ops)
    n_fwd = len(ops)
    assert all(n.phase is B for n in p.nodes[n_fwd:])
    tangents = [i for i in p.backward_ids if not p.nodes[i].inputs]
    assert tangents == [n_fwd]
    assert p.outputs[0] == n_fwd - 1  # the loss
    for i in p.backward_ids[1:]:  # every other backward node reads a gradient
        assert any(p.nodes[j].phase is B for j in p.nodes[i].inputs)
    for i in p.outputs[1:]:
        assert p.nodes[i].phase is B


def _count(p: Problem, phase: Phase) -> int:
    return sum(1 for n in p.nodes if n.phase is phase)


@pytest.mark.parametrize(
    "make",
    [
        lambda: builders.chain(6),
        lambda: builders.heterogeneous_chain([1, 2, 3], [0.5, 1.0, 2.0]),
        lambda: builders.random_dag(30, seed=5, nonrecomputable_prob=0.1, view_prob=0.2),
        lambda: builders.transformer(2, batch=1, seq=8, d_model=16, n_heads=2, vocab=32, dropout=True),
        lambda: builders.unet(3, batch=1, channels=4, resolution=32),
    ],
)
def test_named_builders_have_a_full_backward(make):
    p = make()
    params = [i for i, n in enumerate(p.nodes) if n.phase is P]
    assert len(p.outputs) == 1 + len(params)  # loss + one gradient per parameter
    assert p.budget_bytes == builders.no_remat_peak(p)
    assert p.decision_ids and p.backward_ids
    assert _count(p, B) > _count(p, F)


def test_heterogeneous_chain_uses_the_given_layers():
    p = builders.heterogeneous_chain([10, 20, 30], [1.0, 2.0, 4.0], param_bytes=3)
    layers = [n for n in p.nodes if n.phase is F and n.name.startswith("h")]
    assert [(n.out_bytes, n.compute_s) for n in layers] == [(10, 1.0), (20, 2.0), (30, 4.0)]
    assert all(n.out_bytes == 3 for n in p.nodes if n.phase is P)
    with pytest.raises(ValueError, match="equal length"):
        builders.heterogeneous_chain([1, 2], [1.0])


def test_random_dag_is_seeded():
    assert builders.random_dag(40, seed=7) == builders.random_dag(40, seed=7)
    assert builders.random_dag(40, seed=7) != builders.random_dag(40, seed=8)
    p = builders.random_dag(200, seed=1, skip_prob=0.5)
    skips = [n for n in p.nodes if n.phase is F and len(n.inputs) == 3]
    assert skips


def test_transformer_has_views_and_saved_dropout_masks():
    p = builders.transformer(2, batch=1, seq=8, d_model=16, n_heads=2, vocab=32, dropout=True)
    views = [i for i in p.forward_ids if p.nodes[i].alias_of is not None]
    assert {p.nodes[i].name for i in views} == {"qh_0", "kh_0", "vh_0", "merge_0", "qh_1", "kh_1", "vh_1", "merge_1"}
    assert set(views) & set(p.decision_ids)  # backward reads head views
    masks = [i for i in p.decision_ids if not p.nodes[i].recomputable]
    assert len(masks) == 4 and all(p.nodes[i].name.endswith("_mask") for i in masks)
    for solver in ("all", "chen-sqrt", "chen-greedy"):
        plan = solve(builders.with_budget_fraction(p, 0.7), solver)
        assert all(plan.decisions[i] is Decision.SAVE for i in masks)
    no_dropout = builders.transformer(2, batch=1, seq=8, d_model=16, n_heads=2, vocab=32)
    assert all(no_dropout.nodes[i].recomputable for i in no_dropout.forward_ids)


def test_unet_long_skips_have_view_gradients():
    p = builders.unet(2, batch=1, channels=4, resolution=16)
    cat_grads = [n for n in p.nodes if n.phase is B and "_from_cat" in n.name]
    assert len(cat_grads) == 4 and all(n.alias_of is not None for n in cat_grads)
    # The encoder output enc0_relu is read by down0 and cat0: a long skip.
    enc0 = next(i for i, n in enumerate(p.nodes) if n.name == "enc0_relu")
    assert [p.nodes[u].name for u in p.users[enc0] if p.nodes[u].phase is F] == ["down0", "cat0"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: builders.chain(2500),
        lambda: builders.random_dag(2400, seed=0, view_prob=0.1, nonrecomputable_prob=0.05),
        lambda: builders.transformer(150, dropout=True),
    ],
)
def test_10k_node_problems_build(make):
    # Build time (~0.15 s unloaded) is a benchmark fact (bench/solvers.py), not asserted here.
    p = make()
    assert len(p.nodes) >= 9_000
