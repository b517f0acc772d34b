"""Cut points for Chen's segmentation: strict articulation points, and loose ones that
tolerate small values shared across blocks (rotary tables, masks in transformers)."""

from remat_solvers import Phase
from remat_solvers.builders import FwdOp, joint_from_forward
from remat_solvers.chen import cut_candidates, loose_cut_candidates


def _blocks_sharing_a_small_value(n_blocks: int = 3):
    """x -> [block: h = f(h, shared)] * n -> loss, where `shared` (small) is read by every block."""
    ops = [
        FwdOp(name="w", out_bytes=64, phase=Phase.PARAM),
        FwdOp(name="x", out_bytes=1000, phase=Phase.INPUT),
        FwdOp(name="shared", out_bytes=10, inputs=(1,), compute_s=1.0),  # id 2
    ]
    h = 1
    for b in range(n_blocks):
        ops.append(FwdOp(name=f"a{b}", out_bytes=1000, inputs=(h, 0, 2), compute_s=1.0, grad_reads=(h, 2)))
        ops.append(FwdOp(name=f"h{b}", out_bytes=1000, inputs=(len(ops) - 1,), compute_s=1.0,
                         grad_reads=(len(ops),)))
        h = len(ops) - 1
    ops.append(FwdOp(name="loss", out_bytes=4, inputs=(h,), compute_s=1.0, grad_reads=(h,)))
    return joint_from_forward(ops)


def test_shared_small_value_hides_strict_cuts_but_not_loose_ones():
    problem = _blocks_sharing_a_small_value()
    names = {i: problem.nodes[i].name for i in problem.forward_ids}
    strict = [names[i] for i in cut_candidates(problem)]
    loose = [names[i] for i in loose_cut_candidates(problem)]
    # `shared` is read by every block, so only the values after the last block's
    # reader of `shared` are strict cuts
    assert "h0" not in strict and "h1" not in strict
    assert "h0" in loose and "h1" in loose and "h2" in loose
    assert set(strict) <= set(loose)


def test_loose_cut_rejects_a_crossing_value_that_is_not_small():
    problem = _blocks_sharing_a_small_value()
    names = {i: problem.nodes[i].name for i in problem.forward_ids}
    # with no tolerance, loose cuts are exactly the strict ones
    assert [names[i] for i in loose_cut_candidates(problem, fraction=0.0)] == [
        names[i] for i in cut_candidates(problem)]
