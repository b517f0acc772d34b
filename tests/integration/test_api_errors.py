"""The error paths of `remat.plan`: every failure a user can act on is a `RematError` whose
message says what was wrong and what to do. Small hand-written models keep this fast."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetError, InfeasibleBudgetError, RematError, TraceError

SOLVER = "chen-greedy"  # "auto" may not be registered yet; the error paths do not depend on it


class TinyNet(nn.Module):
    """Two linear layers and a scalar loss: the smallest model with activations to plan."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


class ItemBranch(nn.Module):
    """Control flow driven by a tensor's value through `.item()`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum().item() > 0:  # BRANCH-ITEM
            y = y * 2
        return y.pow(2).mean()


class NonzeroBranch(nn.Module):
    """Control flow driven by how many elements `torch.nonzero` finds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        found = torch.nonzero(y > 0)  # BRANCH-NONZERO
        if found.shape[0] > 3:
            y = y * 2
        return y.pow(2).mean()


class NoLoss(nn.Module):
    """Returns logits, not a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class DictWithoutLoss(nn.Module):
    """Returns a dict that has no "loss" entry."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x)}


class Frozen(nn.Module):
    """No parameter requires grad: there is no backward to plan."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _line_of(cls: type, marker: str) -> int:
    """The line number in this file of the source line of `cls` holding `marker`."""
    lines, first = inspect.getsourcelines(cls)
    for offset, line in enumerate(lines):
        if marker in line:
            return first + offset
    raise AssertionError(f"{marker} not found in {cls.__name__}")


# --- infeasible budgets ---------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 100, "1KB", "1%"])
def test_infeasible_budget_states_smallest_peak_in_bytes_and_mib(budget):
    with pytest.raises(InfeasibleBudgetError) as info:
        remat.plan(TinyNet(), (_x(),), budget=budget, solver=SOLVER)
    e = info.value
    assert isinstance(e, RematError)
    assert 0 < e.budget_bytes < e.min_peak_bytes
    message = str(e)
    assert f"{e.min_peak_bytes} B" in message or f"{e.min_peak_bytes} bytes" in message, message
    assert f"{e.min_peak_bytes / 2**20:.2f} MiB" in message, message
    assert str(e.budget_bytes) in message, message
    assert "raise" in message  # says what to do


def test_infeasible_minimum_is_reachable():
    """The smallest peak the error states is a budget that plans, and planning below it
    by one byte fails again with the same minimum."""
    with pytest.raises(InfeasibleBudgetError) as info:
        remat.plan(TinyNet(), (_x(),), budget=1, solver=SOLVER)
    reach = info.value.min_peak_bytes
    planned = remat.plan(TinyNet(), (_x(),), budget=reach, solver=SOLVER)
    assert planned.budget_bytes == reach
    assert planned.predicted_peak_bytes <= reach
    with pytest.raises(InfeasibleBudgetError) as again:
        remat.plan(TinyNet(), (_x(),), budget=reach - 1, solver=SOLVER)
    assert again.value.min_peak_bytes == reach


# --- malformed budgets ----------------------------------------------------------------

ACCEPTED_EXAMPLES = ("800MB", "1.5GiB", "60%")


@pytest.mark.parametrize("budget", ["lots", "5 parsecs", "", "-1MB", "12 MB!", "60 %%", None, True])
def test_malformed_budget_lists_accepted_forms(budget):
    with pytest.raises(BudgetError) as info:
        remat.plan(TinyNet(), (_x(),), budget=budget, solver=SOLVER)
    message = str(info.value)
    assert isinstance(info.value, RematError)
    assert repr(budget) in message, message  # names the value it rejected
    for example in ACCEPTED_EXAMPLES:
        assert example in message, message
    for unit in ("KiB", "MiB", "GiB", "KB", "MB", "GB", "%"):
        assert unit in message, message


@pytest.mark.parametrize("budget,words", [(0, "positive"), (-3, "positive"), ("0%", "positive"),
                                          (1.5, "float")])
def test_nonpositive_or_float_budget_says_why(budget, words):
    with pytest.raises(BudgetError, match=re.escape(repr(budget))) as info:
        remat.plan(TinyNet(), (_x(),), budget=budget, solver=SOLVER)
    assert words in str(info.value)


def test_percentage_budget_is_of_the_no_remat_peak():
    planned = remat.plan(TinyNet(), (_x(),), budget="100%", solver=SOLVER)
    assert planned.budget_bytes == planned.baseline_peak_bytes
    assert planned.predicted_peak_bytes == planned.baseline_peak_bytes


# --- untraceable models ---------------------------------------------------------------


@pytest.mark.parametrize("model_cls,marker", [(ItemBranch, "BRANCH-ITEM"), (NonzeroBranch, "BRANCH-NONZERO")])
def test_data_dependent_control_flow_raises_trace_error_naming_the_line(model_cls, marker):
    with pytest.raises(TraceError) as info:
        remat.plan(model_cls(), (_x(),), budget="100%", solver=SOLVER)
    message = str(info.value)
    assert isinstance(info.value, RematError)
    assert f"{__file__}:{_line_of(model_cls, marker)}" in message, message
    assert "control flow" in message  # says what to change
    assert "remat.backend" in message  # and where such a model can still be planned


def test_the_backend_plans_a_model_remat_plan_cannot_trace():
    """The TraceError sends users to remat.backend: dynamo splits the graph at the branch
    and each piece is planned (eager compiler: bit-exact)."""
    import copy

    torch._dynamo.reset()
    model = ItemBranch()
    eager = copy.deepcopy(model)
    be = remat.backend(budget="100%", solver=SOLVER, compiler="eager")
    loss = torch.compile(model, backend=be)(_x())
    loss.backward()
    expected = eager(_x())
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    assert len(be.steps) >= 2  # one plan per graph dynamo captured
    assert "whole-step budget '100%' shared by 2 graph calls" in be.summary()  # one budget for the step


# --- no scalar loss and other misuse --------------------------------------------------


@pytest.mark.parametrize("model_cls", [NoLoss, DictWithoutLoss])
def test_model_without_scalar_loss_raises_clear_error(model_cls):
    with pytest.raises(RematError, match="no scalar loss") as info:
        remat.plan(model_cls(), (_x(),), budget="100%", solver=SOLVER)
    assert "`.loss`" in str(info.value)  # says how to return one


def test_frozen_model_has_nothing_to_plan():
    with pytest.raises(RematError, match="require grad"):
        remat.plan(Frozen(), (_x(),), budget="100%", solver=SOLVER)


def test_non_module_is_rejected():
    with pytest.raises(RematError, match="torch.nn.Module"):
        remat.plan(lambda x: x.sum(), (_x(),), budget="100%", solver=SOLVER)


def test_unknown_solver_lists_valid_ones():
    with pytest.raises(remat.UnknownSolverError, match=r"unknown solver 'no-such-solver'; valid solvers: .*chen-greedy"):
        remat.plan(TinyNet(), (_x(),), budget="100%", solver="no-such-solver")


def test_floor_if_refused_plans_the_floor_and_keeps_the_refusal():
    """Below the floor, `floor_if_refused=True` plans at the refusal's `min_peak_bytes`
    from the one trace: the plan `remat.plan` makes at that budget, bit-exact as eager."""
    torch.manual_seed(0)
    model, x = TinyNet(), _x()
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (x,), budget=1000)
    planned = remat.plan(model, (x,), budget=1000, floor_if_refused=True)
    refusal = planned.step.refusal
    assert isinstance(refusal, remat.InfeasibleBudgetError) and refusal.__traceback__ is None
    assert refusal.budget_bytes == 1000 and refusal.min_peak_bytes == refused.value.min_peak_bytes
    at_floor = remat.plan(model, (x,), budget=refusal.min_peak_bytes)
    assert at_floor.step.refusal is None
    assert planned.budget_bytes == at_floor.budget_bytes == refusal.min_peak_bytes
    assert planned.plan.decisions == at_floor.plan.decisions
    assert planned.predicted_peak_bytes == at_floor.predicted_peak_bytes <= refusal.min_peak_bytes
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    planned(x).backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
