"""Every parameter's gradient through `torch.compile(model, backend=remat.backend(...))`
with inductor equals eager's, on small random compositions of blocks
(`remat.testing.compositions`: norms before or after the residual, gated MLPs,
attention, the loss inside or outside the compiled module), with nothing recomputed
(budget "100%") and with everything recomputed that can be (solver "all"); on zoo
models in `test_backend_gradients_zoo.py`; the eager runtime's own fuzz is
`tests/runtime/test_compositions.py`.

Tolerance: relative 1e-4 (absolute 1e-6 for gradients near zero). Inductor's generated
kernels vectorize transcendental functions and reorder reductions, so its float32
results differ from eager's in the last bits (1e-7 relative on these models); a wrong
buffer or a wrong schedule is off by orders of magnitude (the donated-buffer bug left a
weight gradient at 1e-4 of its norm)."""

from __future__ import annotations

import pytest
import torch

import remat
from nets import PLANS, assert_gradients_match
from remat.testing.compositions import BACKEND, WIDE, composition, describe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


SEEDS = (0, 1, 4, 6, 7, 9)
"""Compositions covering post-, pre- and shared norms, gated MLPs, attention, the loss
inside and outside; 7 and 9 (the loss inside, a shared LayerNorm last) gave a wrong
weight gradient when a value and its view were both saved (`remat_solvers.shared_storage`)."""


WIDE_SEEDS = (0, 6)
"""From `WIDE`: two `nn.MultiheadAttention` blocks after token embeddings, the loss
outside (0); a tied head over MLPs and attention without a norm, the loss inside (6)."""


DRAWS = [pytest.param(BACKEND, seed, id=str(seed)) for seed in SEEDS] + [
    pytest.param(WIDE, seed, id=f"wide-{seed}") for seed in WIDE_SEEDS]


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize(("kinds", "seed"), DRAWS)
def test_random_compositions_train_as_eager_through_the_backend(kinds, seed, plan):
    torch._dynamo.reset()
    model, x = composition(seed, kinds)
    be = remat.backend(**PLANS[plan])
    compiled = torch.compile(model, backend=be)
    assert_gradients_match(model, lambda m: compiled(x), lambda m: m(x),
                           f"composition {seed} ({describe(model)}), {plan}")
    assert be.steps  # remat planned what ran
    for step in be.steps:  # a percentage is of inductor's no-remat peak: "100%" is that peak
        assert step.no_remat_margin_bytes is not None
        assert step.budget_bytes == step.no_remat_peak_bytes
        assert step.evaluation.peak_bytes + step.fusion_margin_bytes <= step.budget_bytes
    if plan == "all recomputed":
        assert any(step.evaluation.recomputed_ids for step in be.steps)
