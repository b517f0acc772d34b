"""The hand-made chain problem shared by the torch-free tests that derive their expected
numbers by hand (tests/solver/test_simulate.py, tests/solver/test_prefetch.py)."""

from __future__ import annotations

from remat_solvers import Node, Phase, Problem

F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT


def chain(*, bandwidth: float | None = None, budget: int = 10_000, c_recomputable: bool = True,
          gc_s: float = 0.0, gb_s: float = 0.0, ga_s: float = 0.0) -> Problem:
    """x -> a -> b -> c -> d(loss); backward: t (tangent), gc, gb, ga.

    id  name  phase  bytes  compute  reads
    0   x     input   10
    1   a     fwd    100    1.0      x
    2   b     fwd    100    2.0      a
    3   c     fwd    100    4.0      b
    4   d     fwd      4    8.0      c        (the loss, an output)
    5   t     bwd      4             -        (loss tangent)
    6   gc    bwd    100    gc_s     t, c
    7   gb    bwd    100    gb_s     gc, b
    8   ga    bwd    100    ga_s     gb, a    (an output)
    decision_ids = (1, 2, 3): c, b, a are read by backward; d is not.
    """
    return Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
            Node(name="b", inputs=(1,), out_bytes=100, phase=F, compute_s=2.0),
            Node(name="c", inputs=(2,), out_bytes=100, phase=F, compute_s=4.0, recomputable=c_recomputable),
            Node(name="d", inputs=(3,), out_bytes=4, phase=F, compute_s=8.0),
            Node(name="t", inputs=(), out_bytes=4, phase=B),
            Node(name="gc", inputs=(5, 3), out_bytes=100, phase=B, compute_s=gc_s),
            Node(name="gb", inputs=(6, 2), out_bytes=100, phase=B, compute_s=gb_s),
            Node(name="ga", inputs=(7, 1), out_bytes=100, phase=B, compute_s=ga_s),
        ),
        outputs=(4, 8),
        budget_bytes=budget,
        offload_bandwidth_bytes_per_s=bandwidth,
    )
