"""Small torch models and checks shared by the tests that plan real modules.

(`oracles.py` and `strategies.py` serve the torch-free solver tests; this one imports torch.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


class Tower(nn.Module):
    """`depth` Linear+Tanh layers, `d` wide, a Linear head and a squared-mean loss: the
    smallest model whose activations scale with depth and whose plans are easy to read."""

    def __init__(self, d: int = 64, depth: int = 4):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.layers(x)).square().mean()


def assert_trains_like_eager(loss, loss_eager, model: nn.Module, eager: nn.Module, where: str = "") -> None:
    """Loss, every gradient and every buffer (BatchNorm's running stats: updated once)
    `torch.equal` to eager's, after both ran their backward."""
    at = f"{where}: " if where else ""
    assert torch.equal(loss, loss_eager), f"{at}loss differs"
    for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(b.grad, a.grad), f"{at}gradient of {name} differs"
    for (name, a), b in zip(eager.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(b, a), f"{at}buffer {name} differs"


def train_step(model, case, seed: int = 0):
    """One forward + backward of a zoo-style case (`case.args`, `case.kwargs`) under
    `seed`; the loss is the output when it is a tensor, else its `.loss`. Returns the
    output, kept alive as a training loop holding its outputs would."""
    torch.manual_seed(seed)
    out = model(*case.args, **case.kwargs)
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    return out


def grad_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name in `named_parameters()` order: what
    a step left, kept safe from the next step's accumulation."""
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def step_and_take_grads(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
                        seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step under `seed`: `model(*args, **kwargs)`, the backward of its loss
    (the output when it is a tensor, else its `.loss`). Returns the detached loss and
    every parameter's gradient by name, taken off the parameters (each left at None), so
    the next step starts from none and cannot accumulate into what was returned."""
    torch.manual_seed(seed)
    out = model(*args, **(kwargs or {}))
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name], p.grad = p.grad, None
    return loss.detach(), grads


def step_from_cleared_grads(fn, module: nn.Module, *args, seed: int | None = None) -> torch.Tensor:
    """One training step of `fn` (`module`, or a compiled or planned form of it) from
    cleared gradients of `module`: the loss `fn(*args)` returns, under `seed` when given,
    and its backward. Returns the detached loss; the gradients stay on `module`'s
    parameters for the caller to compare."""
    module.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = fn(*args)
    loss.backward()
    return loss.detach()


def needs_torch(major: int, minor: int, why: str):
    """Skip on a torch older than `major.minor`, saying why (what that torch does)."""
    from remat import compat

    return pytest.mark.skipif(not compat.at_least(major, minor), reason=f"needs torch >= {major}.{minor}: {why}")


def _loss(out):
    return out if out.ndim == 0 else out.pow(2).mean()


def assert_gradients_match(model: nn.Module, run, eager_run, where: str) -> None:
    """Every parameter's gradient after `run(model)` close to eager's after `eager_run` on
    a copy (rtol 1e-4, atol 1e-6: inductor's rounding, `test_backend_gradients.py`); an
    output that is not a scalar is reduced by a squared mean."""
    eager = copy.deepcopy(model)
    _loss(eager_run(eager)).backward()
    _loss(run(model)).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{where}: gradient of {name}: {m}")


PLANS = {"nothing recomputed": {"budget": "100%"}, "all recomputed": {"budget": "100%", "solver": "all"}}
"""The two ends of the plan space through `remat.backend`: nothing recomputed, everything."""


def train_zoo_model_through_the_backend(name: str, plan: str) -> None:
    """Zoo model `name` at its "micro" size through `remat.backend` with inductor under
    `PLANS[plan]`: every parameter's gradient as eager's (`assert_gradients_match`).
    Dropout is off (inductor draws other random numbers than eager); batch norm stays in
    training mode, so its batch statistics and their backward are recomputed too."""
    import remat
    from remat.testing import zoo

    torch._dynamo.reset()
    case = zoo.build(name, size="micro")
    case.model.eval()
    for module in case.model.modules():
        if isinstance(module, nn.BatchNorm2d):  # the zoo's only norm with a training mode
            module.train()
    with torch.no_grad():  # transformers settles `config.problem_type` on the first call
        case.model(*case.args, **case.kwargs)
    be = remat.backend(**PLANS[plan])
    compiled = torch.compile(case.model, backend=be)
    assert_gradients_match(case.model, lambda m: compiled(*case.args, **case.kwargs).loss,
                           lambda m: m(*case.args, **case.kwargs).loss, f"{name}, {plan}")
    assert be.steps  # remat planned what ran
    if plan == "all recomputed":
        assert any(step.evaluation.recomputed_ids for step in be.steps)


def compiled_zoo_step(name: str, budget: int | str) -> tuple:
    """Zoo model `name` (tiny) compiled through `remat.backend(budget, outputs="loss")`,
    its first step run: (the case, the backend, the step). A no-grad call first settles
    what transformers sets on its first call (`config.problem_type`), so the second step
    does not recompile."""
    import remat
    from remat.testing import zoo

    torch._dynamo.reset()
    case = zoo.build(name, size="tiny")
    with torch.no_grad():
        case.model(*case.args, **case.kwargs)
    be = remat.backend(budget=budget, outputs="loss")
    fn = torch.compile(case.model, backend=be)

    def step():
        fn(*case.args, **case.kwargs).loss.backward()

    step()
    return case, be, step


def zoo_step_through_the_backend(name: str, budget: str = "100%") -> tuple:
    """Zoo model `name` (tiny) compiled through `remat.backend(budget, outputs="loss")`,
    one step run, then one measured by the profiler with what the step takes registered:
    (the planned step, the measurement)."""
    import remat
    from remat.testing import zoo

    torch._dynamo.reset()
    case = zoo.build(name, size="tiny")
    be = remat.backend(budget=budget, outputs="loss")
    compiled = torch.compile(case.model, backend=be)

    def step():
        compiled(*case.args, **case.kwargs).loss.backward()

    step()
    (planned,) = be.steps
    case.model.zero_grad(set_to_none=True)
    measured = be.measure(step, register=[*case.model.parameters(), *case.model.buffers(), *case.args,
                                          *case.kwargs.values()])
    return planned, measured
