"""The memory model on hand-computed cases: every expected number is derived in the
comments from the rules in solvers/simulate.py, never copied from its output (most run on
the chain of tests/chains.py)."""

from __future__ import annotations

import math

import pytest

from remat_solvers import Decision, Node, Phase, Plan, PlanError, Problem, Status, StepKind, simulate
from remat_solvers.simulate import evaluate
from chains import chain

S, R, O = Decision.SAVE, Decision.RECOMPUTE, Decision.OFFLOAD
F, B, I, P = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT, Phase.PARAM


def _plan(a: Decision, b: Decision, c: Decision) -> dict[int, Decision]:
    return {1: a, 2: b, 3: c}


def test_chain_decision_ids():
    assert chain().decision_ids == (1, 2, 3)
    assert chain().needed_ids == frozenset({1, 2, 3})


def test_chain_all_save():
    # x (10) is live all step. Steps: Fa Fb Fc Fd Bt Bgc Bgb Bga.
    # Fa 10+100=110; Fb 210; Fc 310; Fd 314 (all saved, nothing freed in forward);
    # Bt 318; Bgc 418, then c (last use) and t free -> 314; Bgb 414, b and gc free -> 214;
    # Bga 314, a and gb free -> 114 (x, d, ga remain). Peak 418 at Bgc (step 5). Cost 0.
    ev = evaluate(chain(), _plan(S, S, S))
    assert ev.timeline == (110, 210, 310, 314, 318, 418, 414, 314)
    assert (ev.peak_bytes, ev.peak_step) == (418, 5)
    assert ev.recompute_s == 0.0 and ev.cost_s == 0.0 and ev.offload_bytes == 0
    assert ev.recomputed_ids == ()


def test_chain_all_recompute():
    # Forward frees each value after its next op reads it:
    # Fa 110; Fb 210 (a freed -> 110); Fc 210 (b freed -> 110); Fd 114 (c freed -> 14).
    # Bt 18. gc needs c -> needs b -> needs a: Ra 118, Rb 218, Rc 318 (a and b stay: ga and
    # gb read them later). Bgc 418 -> c,t free -> 314. Bgb 414 -> b,gc free -> 214.
    # Bga 314 -> 114. Peak 418 at Bgc (step 8); cost 1+2+4 = 7.
    ev = evaluate(chain(), _plan(R, R, R))
    assert ev.timeline == (110, 210, 210, 114, 18, 118, 218, 318, 418, 414, 314)
    assert (ev.peak_bytes, ev.peak_step) == (418, 8)
    assert ev.recompute_s == 7.0 and ev.cost_s == 7.0
    assert ev.recomputed_ids == (1, 2, 3)
    kinds = [(s.node_id, s.kind) for s in ev.steps[5:8]]
    assert kinds == [(1, StepKind.RECOMPUTE), (2, StepKind.RECOMPUTE), (3, StepKind.RECOMPUTE)]


def test_chain_mixed_recompute_first():
    # a RECOMPUTE, b and c SAVE: Fa 110; Fb 210 (a freed -> 110); Fc 210; Fd 214; Bt 218;
    # Bgc 318 -> c,t free -> 214; Bgb 314 -> b,gc free -> 114; Ra 214; Bga 314 -> 114.
    # Peak 318 at Bgc (step 5), 100 below all-SAVE, for cost 1.0 (a once).
    ev = evaluate(chain(), _plan(R, S, S))
    assert ev.timeline == (110, 210, 210, 214, 218, 318, 314, 214, 314)
    assert (ev.peak_bytes, ev.peak_step, ev.cost_s) == (318, 5, 1.0)
    assert ev.fits


def test_chain_mixed_recompute_last():
    # c RECOMPUTE only: Fa 110; Fb 210; Fc 310; Fd 314 (c freed -> 214); Bt 218;
    # Rc 318 (reads the saved b); Bgc 418. Peak 418 (step 6), cost 4.0: no gain.
    ev = evaluate(chain(), _plan(S, S, R))
    assert (ev.peak_bytes, ev.peak_step, ev.cost_s) == (418, 6, 4.0)
    assert ev.timeline[:7] == (110, 210, 310, 314, 218, 318, 418)


def test_fits_is_inclusive():
    assert evaluate(chain(budget=318), _plan(R, S, S)).fits
    assert not evaluate(chain(budget=317), _plan(R, S, S)).fits


def test_plan_object_and_mapping_agree():
    plan = Plan(decisions=_plan(R, S, S), status=Status.FEASIBLE, solver="hand", objective_s=1.0, peak_bytes=318)
    assert simulate(chain(), plan) == simulate(chain(), _plan(R, S, S))


# ---- views ----


def _view_problem() -> Problem:
    """x -> a -> v (a view of a) -> y; backward reads v only.

    id name phase bytes compute reads
    0  x    input  10
    1  a    fwd   100   1.0     x
    2  v    fwd   100   0.5     a     (alias_of a: no storage of its own)
    3  y    fwd    20   1.0     v     (output)
    4  t    bwd    20           -
    5  gv   bwd   100           t, v  (output)
    decision_ids = (1, 2): v is read by backward, a is its forward ancestor.
    """
    return Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
            Node(name="v", inputs=(1,), out_bytes=100, phase=F, compute_s=0.5, alias_of=1),
            Node(name="y", inputs=(2,), out_bytes=20, phase=F, compute_s=1.0),
            Node(name="t", inputs=(), out_bytes=20, phase=B),
            Node(name="gv", inputs=(4, 2), out_bytes=100, phase=B),
        ),
        outputs=(3, 5),
        budget_bytes=1000,
    )


def test_saved_view_keeps_base_storage_alive_counted_once():
    # a RECOMPUTE, v SAVE. a's own last use is Fv (step 1), but the saved view v shares
    # its storage, so the storage lives until gv (step 4). Bytes counted once:
    # Fa 110; Fv 110 (alias, no new storage); Fy 130; Bt 150; Bgv 250.
    # (Counted twice the peak would be 350; freed with a it would be 30 at Fy.)
    ev = evaluate(_view_problem(), {1: R, 2: S})
    assert ev.timeline == (110, 110, 130, 150, 250)
    assert ev.peak_bytes == 250
    assert ev.cost_s == 0.0 and ev.recomputed_ids == ()  # v is on device: a never recomputed


def test_all_save_view_counted_once():
    ev = evaluate(_view_problem(), {1: S, 2: S})
    assert ev.timeline == (110, 110, 130, 150, 250)


def test_recomputed_view_shares_recomputed_base():
    # Both RECOMPUTE: the storage of a (and its view v) is freed after Fy (step 2), the
    # last forward read: Fa 110; Fv 110; Fy 130 -> 30; Bt 50; Ra 150; Rv 150 (alias);
    # Bgv 250. Cost 1.0 + 0.5.
    ev = evaluate(_view_problem(), {1: R, 2: R})
    assert ev.timeline == (110, 110, 130, 50, 150, 150, 250)
    assert ev.cost_s == 1.5 and ev.recomputed_ids == (1, 2)


# ---- offload ----


def test_offload_lowers_peak_with_exact_transfer():
    # Bandwidth 100 B/s. a OFFLOAD, b and c SAVE: a leaves the device after Fb (its last
    # forward use) and is reloaded just before Bga: the same timeline as recomputing it:
    # 110 210 210 214 218 318 314 214(reload) 314; peak 318 (all-SAVE: 418).
    # offload_bytes = 100; transfer 100 out + 100 back at 100 B/s = 2.0 s. The copy out
    # starts after Fb and overlaps Fc + Fd (12 s of compute): hidden; the reload is
    # waited for: 1.0 s exposed. No recompute.
    ev = evaluate(chain(bandwidth=100.0), _plan(O, S, S))
    assert ev.timeline == (110, 210, 210, 214, 218, 318, 314, 214, 314)
    assert ev.peak_bytes == 318
    assert ev.offload_bytes == 100 and ev.transfer_s == 2.0 and ev.recompute_s == 0.0
    assert ev.offload_s == 1.0 and ev.hidden_transfer_s == 1.0
    assert ev.cost_s == 1.0
    assert ev.steps[7] == ev.steps[7].__class__(1, StepKind.RELOAD)


def test_offload_then_recompute_from_reloaded():
    # a OFFLOAD, b RECOMPUTE, c SAVE: Fa 110; Fb 210 (a offloaded -> 110); Fc 210 (b
    # freed -> 110); Fd 114; Bt 118; Bgc 218 -> c,t free -> 114; before gb: reload a
    # (214), recompute b (314); Bgb 414 -> b,gc free -> 214; Bga 314 -> 114.
    # Peak 414; cost = b 2.0 + the reload 100 B / 100 B/s = 3.0 (the copy out is hidden).
    ev = evaluate(chain(bandwidth=100.0), _plan(O, R, S))
    assert ev.timeline == (110, 210, 210, 114, 118, 218, 214, 314, 414, 314)
    assert ev.peak_bytes == 414 and ev.cost_s == 3.0


def test_offload_store_is_exposed_beyond_the_forward_compute_it_overlaps():
    # Bandwidth 10 B/s: 10 s per copy. b's copy out starts after Fc (its last forward
    # use) and overlaps Fd only (8 s): 2 s stick out; its reload shows in full (10 s).
    # c's copy out starts after Fd, the last forward node: nothing hides it.
    p = chain(bandwidth=10.0)
    assert p.store_overlap_s[1:4] == (12.0, 8.0, 0.0)
    ev = evaluate(p, _plan(S, O, S))
    assert (ev.transfer_s, ev.offload_s, ev.hidden_transfer_s) == (20.0, 12.0, 8.0)
    ev = evaluate(p, _plan(S, S, O))
    assert (ev.transfer_s, ev.offload_s, ev.hidden_transfer_s) == (20.0, 20.0, 0.0)


# ---- explicit schedules ----


def test_explicit_schedule_recomputes_twice_with_lower_peak():
    # All RECOMPUTE; canonical peak 418 (test_chain_all_recompute). Explicit backward:
    # t, a, b, c, gc, a, b, gb, a, ga: each recomputed instance dies at its only reader.
    # Forward as before: 110 210 210 114 (14 after). Bt 18; Ra 118; Rb 218 (a -> 118);
    # Rc 218 (b -> 118); Bgc 218 (c,t -> 114); Ra 214; Rb 314 (a -> 214); Bgb 314
    # (b,gc -> 114); Ra 214; Bga 314. Peak 314 at step 10; cost a*3 + b*2 + c = 11.
    schedule = (5, 1, 2, 3, 6, 1, 2, 7, 1, 8)
    ev = evaluate(chain(), _plan(R, R, R), schedule)
    assert ev.timeline == (110, 210, 210, 114, 18, 118, 218, 218, 218, 214, 314, 314, 214, 314)
    assert (ev.peak_bytes, ev.peak_step) == (314, 10)
    assert ev.recompute_s == 11.0 and ev.recomputed_ids == (1, 2, 3)
    assert ev.peak_bytes < evaluate(chain(), _plan(R, R, R)).peak_bytes


def test_explicit_schedule_equal_to_canonical():
    # The canonical order written out gives the canonical evaluation.
    assert evaluate(chain(), _plan(R, S, S), (5, 6, 7, 1, 8)) == evaluate(chain(), _plan(R, S, S))


@pytest.mark.parametrize(
    ("decisions", "schedule", "message"),
    [
        # The first error wins: schedule[1] is bad, schedule[2] would be too.
        (_plan(R, R, R), (5, 2, 99), "schedule[1] = 2 ('b') reads node 1 ('a'), which is not on the device"),
        (_plan(R, S, S), (5, 5, 6, 7, 1, 8), "schedule[1] = 5 ('t'): backward node scheduled twice"),
        (_plan(S, S, S), (5, 6, 1), "schedule[2] = 1 ('a'): only RECOMPUTE or OFFLOAD values can be scheduled"),
        (_plan(S, S, S), (0, 5), "schedule[0] = 0 ('x'): input values are never scheduled"),
        (_plan(S, S, S), (5, 99), "schedule[1] = 99: not a node id (0..8)"),
        (_plan(S, S, S), (6, 5), "schedule[0] = 6 ('gc') reads backward node 5 ('t') before it runs"),
        (_plan(S, S, S), (5, 6, 7), "schedule never runs backward nodes [8]"),
        (_plan(R, S, S), (5, 6, 7, 8), "schedule[3] = 8 ('ga') reads node 1 ('a'), which is not on the device"),
    ],
)
def test_explicit_schedule_errors_name_the_first_bad_step(decisions, schedule, message):
    with pytest.raises(PlanError) as err:
        evaluate(chain(), decisions, schedule)
    assert message in str(err.value)


def test_explicit_schedule_rejects_recomputing_non_recomputable():
    # c is not recomputable; "dropping" it and scheduling its recompute is an error.
    with pytest.raises(PlanError, match=r"schedule\[1\] = 3 \('c'\): node is not recomputable"):
        evaluate(chain(c_recomputable=False), _plan(S, S, R), (5, 3, 6, 7, 8))


# ---- plan errors ----


def test_missing_and_extra_decisions():
    with pytest.raises(PlanError, match=r"missing \[3\], not decision values \[\]"):
        evaluate(chain(), {1: S, 2: S})
    with pytest.raises(PlanError, match=r"missing \[\], not decision values \[4\]"):
        evaluate(chain(), {1: S, 2: S, 3: S, 4: S})


def test_offload_when_disallowed():
    with pytest.raises(PlanError, match=r"node 1 \('a'\): offload not allowed: offload is disabled"):
        evaluate(chain(), _plan(O, S, S))


def test_offload_of_non_offloadable_node():
    p = chain(bandwidth=100.0)
    nodes = list(p.nodes)
    nodes[1] = Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0, offloadable=False)
    p = Problem(nodes=tuple(nodes), outputs=p.outputs, budget_bytes=1000, offload_bandwidth_bytes_per_s=100.0)
    assert p.allowed(1) == (S, R)
    with pytest.raises(PlanError, match="the node is not offloadable"):
        evaluate(p, _plan(O, S, S))


def test_dropping_needed_non_recomputable_value():
    with pytest.raises(PlanError, match=r"node 3 \('c'\) is not recomputable .* backward node 6 \('gc'\) needs it"):
        evaluate(chain(c_recomputable=False), _plan(S, S, R))


def test_dropping_non_recomputable_value_nobody_needs_is_fine():
    # A non-recomputable value backward does not read is not even a decision value.
    p = chain(c_recomputable=False)
    nodes = list(p.nodes)
    nodes[6] = Node(name="gc", inputs=(5,), out_bytes=100, phase=B)
    p = Problem(nodes=tuple(nodes), outputs=p.outputs, budget_bytes=1000)
    assert p.decision_ids == (1, 2)  # c is no longer a decision value
    # A non-recomputable ancestor of a recomputed value: a needed via b's recompute.
    nodes[1] = Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0, recomputable=False)
    nodes[8] = Node(name="ga", inputs=(7,), out_bytes=100, phase=B)
    p = Problem(nodes=tuple(nodes), outputs=p.outputs, budget_bytes=1000)
    assert p.decision_ids == (1, 2)
    assert evaluate(p, {1: R, 2: S}).recomputed_ids == ()  # dropping a is fine: b is saved
    with pytest.raises(PlanError, match=r"node 1 \('a'\) is not recomputable .* backward node 7 \('gb'\)"):
        evaluate(p, {1: R, 2: R})


# ---- validation ----


def _node(name="n", inputs=(), out_bytes=1, phase=F, **kw):
    return Node(name=name, inputs=inputs, out_bytes=out_bytes, phase=phase, **kw)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _node(out_bytes=-1), "node 'n': out_bytes must be an int >= 0, got -1"),
        (lambda: _node(out_bytes=1.5), "out_bytes must be an int >= 0, got 1.5"),
        (lambda: _node(compute_s=-1.0), "compute_s must be >= 0, got -1.0"),
        (lambda: _node(compute_s=math.nan), "compute_s must be >= 0, got nan"),
        (lambda: _node(phase="forward"), "phase must be a Phase"),
        (lambda: _node(phase=P, inputs=(0,)), "a param node has no inputs"),
        (lambda: _node(inputs=(1,), alias_of=0), "alias_of=0 must be one of its inputs (1,)"),
    ],
)
def test_node_validation(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


def _problem_from_nodes(nodes, outputs=(), budget=10, bandwidth=None):
    """A `Problem` of exactly these nodes, with small defaults: the validation cases
    pass nodes that break one rule each."""
    return Problem(nodes=tuple(nodes), outputs=outputs, budget_bytes=budget,
                   offload_bandwidth_bytes_per_s=bandwidth)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # a forward reference (node 1 reads node 2) and a self-loop (a cycle of length 1)
        (lambda: _problem_from_nodes([_node("x", phase=I), _node("a", (2,)), _node("b", (1,))]),
         "node 1 ('a') reads 2: inputs must be ids of earlier nodes (0..0)"),
        (lambda: _problem_from_nodes([_node("x", phase=I), _node("a", (1,))]),
         "node 1 ('a') reads 1: inputs must be ids of earlier nodes (0..0); the nodes must be in topological order without cycles"),
        (lambda: _problem_from_nodes([_node("x", phase=I), _node("a", (-1,))]), "node 1 ('a') reads -1"),
        (lambda: _problem_from_nodes([_node("x", phase=I), _node("g", (0,), phase=B), _node("a", (0,))]),
         "node 2 ('a') is forward after a backward node"),
        # backward feeding forward
        (lambda: _problem_from_nodes([_node("g", phase=B), _node("a", (0,), phase=F)]),
         "node 1 ('a', forward) reads node 0 ('g', backward): a later phase cannot feed an earlier one"),
        (lambda: _problem_from_nodes([_node("a"), _node("w", phase=P)]), "node 1 ('w') is param after a forward node"),
        (lambda: _problem_from_nodes([_node("x", phase=I)], outputs=(3,)), "output 3 is not a node id (0..0)"),
        (lambda: _problem_from_nodes([_node("x", phase=I)], budget=-1), "budget_bytes must be an int >= 0, got -1"),
        (lambda: _problem_from_nodes([_node("x", phase=I)], bandwidth=0.0), "offload_bandwidth_bytes_per_s must be > 0 or None"),
        (lambda: _problem_from_nodes(["x"]), "nodes[0] must be a Node, got str"),
    ],
)
def test_problem_validation(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


def test_plan_validation():
    with pytest.raises(ValueError, match="status must be a Status"):
        Plan(decisions={}, status="optimal", solver="x", objective_s=0.0, peak_bytes=0)
    with pytest.raises(ValueError, match="decision for node 1 must be a Decision"):
        Plan(decisions={1: "save"}, status=Status.FEASIBLE, solver="x", objective_s=0.0, peak_bytes=0)
