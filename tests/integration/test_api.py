"""The Planned module's contract beyond one step: re-planning per input signature,
sharing the model's state, inference without planning, the summary's content."""

import copy
import logging

import torch
from torch import nn

import remat
from remat_solvers import Decision
from nets import grad_copies


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        logits = self.head(self.layers(x))
        return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}


def _loss(fn, x, y):
    """The loss `fn` returns in its output dict (not run backward)."""
    return fn(x, y)["loss"]


def test_replans_for_new_shapes_and_stays_exact(caplog):
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    x, y = torch.randn(1024, 32), torch.randint(0, 4, (1024,))
    planned = remat.plan(model, (x, y), budget="80%", solver="chen-greedy")
    first_budget = planned.budget_bytes
    x2, y2 = torch.randn(512, 32), torch.randint(0, 4, (512,))
    with caplog.at_level(logging.INFO, logger="remat.api"):
        _loss(planned, x2, y2).backward()
    assert "re-planning" in caplog.text
    _loss(eager, x2, y2).backward()
    assert all(torch.equal(a, b) for a, b in zip(grad_copies(model).values(), grad_copies(eager).values()))
    assert len(planned.__dict__["_remat_cache"]) == 2
    # "80%" was resolved once, against the first signature; the re-plan keeps those bytes
    second = list(planned.__dict__["_remat_cache"].values())[1][0]
    assert second.budget_bytes == first_budget == planned.budget_bytes


def test_shares_state_with_the_model():
    model = Net()
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    planned = remat.plan(model, (x, y), budget="100%", solver="none")
    assert list(planned.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(planned.parameters(), model.parameters()))


def test_no_grad_calls_the_model_directly():
    model = Net()
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    planned = remat.plan(model, (x, y), budget="100%", solver="none")
    with torch.no_grad():
        out = planned(x, y)
    assert torch.equal(out["logits"], model(x, y)["logits"])


def test_summary_names_budget_peak_and_largest_values():
    model = Net()
    x, y = torch.randn(2048, 32), torch.randint(0, 4, (2048,))
    planned = remat.plan(model, (x, y), budget="85%", solver="chen-greedy")
    text = planned.summary()
    assert f"({planned.budget_bytes} B)" in text
    assert f"({planned.predicted_peak_bytes} B)" in text
    assert "largest saved values" in text and "largest recomputed values" in text
    assert "layers.0.1 (Tanh)" in text or "layers.0.0 (Linear)" in text
    assert planned.plan.count(Decision.RECOMPUTE) > 0
