"""Plan a small GPT-2 (random weights, dropout on) at 50% of its no-remat peak, train
three steps, and check the memory promise and the gradients against eager PyTorch.

    HF_HUB_OFFLINE=1 python examples/gpt2_budget.py [--budget 50%] [--solver auto] [--size small]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="50%", help="bytes, '800MB', '1.5GiB' or '50%%'")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--size", default="small", choices=("tiny", "bench", "small"))
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()

    case = zoo.build("gpt2", size=opts.size, seed=0)
    eager_model = copy.deepcopy(case.model)
    planned = remat.plan(case.model, case.args, case.kwargs, budget=opts.budget, solver=opts.solver)
    print(planned.summary())

    inputs = [t for t in (*case.args, *case.kwargs.values()) if isinstance(t, torch.Tensor)]
    opt_remat = torch.optim.SGD(case.model.parameters(), lr=1e-2, momentum=0.9)
    opt_eager = torch.optim.SGD(eager_model.parameters(), lr=1e-2, momentum=0.9)
    ok = True
    print(f"\n{'step':>4} {'loss':>10} {'predicted':>12} {'measured':>12} {'budget':>12}  grads==eager")
    for step in range(opts.steps):
        def remat_step():
            opt_remat.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # same dropout masks as the eager step
            out = planned(*case.args, **case.kwargs)
            out.loss.backward()
            return out.loss.detach()

        measured = measure_step(remat_step, register=(case.model, *inputs))
        opt_eager.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        eager_loss = eager_model(*case.args, **case.kwargs).loss
        eager_loss.backward()
        # the measured step already ran the planned forward+backward: compare its grads
        same = all(
            (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
            for a, b in zip(case.model.parameters(), eager_model.parameters())
        )
        ok &= same and measured.peak_bytes <= planned.budget_bytes
        print(f"{step:>4} {eager_loss.item():>10.4f} {planned.predicted_peak_bytes:>12} "
              f"{measured.peak_bytes:>12} {planned.budget_bytes:>12}  {same}")
        opt_remat.step()
        opt_eager.step()
    params_same = all(torch.equal(a, b) for a, b in zip(case.model.parameters(), eager_model.parameters()))
    print(f"\nparameters equal eager after {opts.steps} steps: {params_same}")
    ok &= params_same
    print("OK: under budget, bit-exact" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
