"""`remat.plan(..., outputs="loss")`: the loss is the only output, so the other tensors
(a language model's logits) die inside the forward instead of being held for the caller
until the step ends, and the plan has that much more room."""

import pytest
import torch

import remat
from remat import compat
from remat.testing import zoo
from remat.errors import RematError
from remat.frontend.problem import FORWARD_END
from remat.testing.measure import measure_step
from nets import grad_copies, train_step

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt2():
    case = zoo.build("gpt2", size="tiny")
    logits = train_step(case.model, case, seed=1).logits
    grads = grad_copies(case.model)
    case.model.zero_grad(set_to_none=True)
    return case, logits.numel() * logits.element_size(), grads


def test_loss_only_returns_none_for_the_rest_and_frees_their_bytes(gpt2):
    case, logits_bytes, eager_grads = gpt2
    model, register = case.model, (case.model, *case.args, *case.kwargs.values())
    kept = remat.plan(model, case.args, dict(case.kwargs), budget="50%", solver="greedy")
    dropped = remat.plan(model, case.args, dict(case.kwargs), budget="50%", solver="greedy", outputs="loss")
    # with the logits held until the step ends the no-remat peak holds them; without, not
    assert kept.baseline_peak_bytes - dropped.baseline_peak_bytes == logits_bytes
    assert dropped.budget_bytes == dropped.baseline_peak_bytes // 2

    out = train_step(dropped, case, seed=1)
    assert out.logits is None and out.loss is not None and type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert all(torch.equal(g, eager_grads[n]) for n, g in grad_copies(model).items())
    model.zero_grad(set_to_none=True)
    measured = measure_step(lambda: train_step(dropped, case, seed=1).loss, register=register).peak_bytes
    assert measured == dropped.predicted_peak_bytes <= dropped.budget_bytes
    model.zero_grad(set_to_none=True)


def test_an_unknown_outputs_value_is_refused_before_tracing():
    model = torch.nn.Linear(4, 1)
    with pytest.raises(RematError, match='outputs=.logits.*"all".*"loss"'):
        remat.plan(model, (torch.randn(2, 4),), budget="50%", outputs="logits")


def test_loss_only_under_inductor():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            h = self.b(torch.tanh(self.a(x)))
            return {"loss": h.pow(2).mean(), "hidden": h}

    torch.manual_seed(0)
    model, x = Net(), torch.randn(32, 16)
    model(x)["loss"].backward()
    eager = grad_copies(model)
    model.zero_grad(set_to_none=True)
    planned = remat.plan(model, (x,), budget="100%", compile=True, outputs="loss")
    out = planned(x)
    out["loss"].backward()
    assert out["hidden"] is None
    for n, g in grad_copies(model).items():
        torch.testing.assert_close(g, eager[n])


# --- remat.backend(outputs="loss"): the caller drops the other outputs before backward ---


class _Wide(torch.nn.Module):
    """The loss's backward never reads `hidden` (a sum's gradient is ones), so the plan
    has no reason to keep it: only the caller could."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 256)

    def forward(self, x):
        hidden = self.b(torch.tanh(self.a(x)))
        return {"loss": hidden.sum(), "hidden": hidden}


def _compiled(outputs, whole_step=True):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(64, 64)
    be = remat.backend(budget="100%", compiler="eager", outputs=outputs, whole_step=whole_step)
    return model, x, be, torch.compile(model, backend=be)


def test_backend_loss_only_holds_the_other_outputs_to_the_forward_end_only():
    model, x, kept_be, compiled = _compiled("all")
    compiled(x)["loss"].backward()
    model, x, be, compiled = _compiled("loss")
    model(x)["loss"].backward()
    eager = grad_copies(model)
    model.zero_grad(set_to_none=True)
    compiled(x)["loss"].backward()
    assert all(torch.equal(g, eager[n]) for n, g in grad_copies(model).items())
    (kept,), (dropped,) = kept_be.steps, be.steps
    hidden_bytes = 64 * 256 * 4
    # held to the end of the step, the hidden output and its gradient's zeros are in the
    # no-remat peak (at the step's end); dropped after the forward (read by the forward's
    # end node only) and freed at its last use (below), neither is
    released = compat.releases_tangents()  # else the zeros are held to the end: one hidden's less
    assert kept.baseline_peak_bytes - dropped.baseline_peak_bytes == (2 if released else 1) * hidden_bytes
    problem, names = dropped.graph_problem.problem, dropped.graph_problem.value_name
    end = names.index(FORWARD_END)
    assert end == problem.forward_ids[-1] and end not in problem.outputs
    (hidden,) = problem.nodes[end].inputs
    assert problem.nodes[hidden].out_bytes == hidden_bytes and hidden not in problem.outputs
    assert kept_be.uuid() != be.uuid()
    # the loss's seed is held by `backward()`'s caller to the end; the zeros autograd
    # materializes for the dropped output's gradient are not (AOTAutograd's backward
    # clears its list of tangents), so they die at their last use
    tangents = {problem.nodes[i].out_bytes: i for i, name in enumerate(names) if name.startswith("tangents")}
    assert sorted(tangents) == [4, hidden_bytes]
    assert tangents[4] in problem.outputs
    # (a torch whose backward takes its gradients unboxed holds them to the end: compat)
    assert (tangents[hidden_bytes] not in problem.outputs) == compat.releases_tangents()
    kept_problem, kept_names = kept.graph_problem.problem, kept.graph_problem.value_name
    assert all(i in kept_problem.outputs for i, name in enumerate(kept_names) if name.startswith("tangents"))

    model.zero_grad(set_to_none=True)
    measured = measure_step(lambda: compiled(x)["loss"].backward(), register=(model, x), instrument="profiler")
    # op by op (compiler="eager") the prediction is exact, the released zeros included
    assert measured.peak_bytes == be.ledger.predicted_step_bytes <= be.ledger.budget_bytes


@pytest.mark.parametrize("whole_step", [True, False])
def test_backend_loss_only_refuses_a_step_that_holds_an_output_at_backward(whole_step):
    from remat.runtime.dropped import DroppedOutputHeldError

    model, x, be, compiled = _compiled("loss", whole_step)
    out = compiled(x)  # held through backward: the plan did not count it
    with pytest.raises(DroppedOutputHeldError, match=r"output 1 \(torch.float32 \[64, 256\], 0.06 MiB \(65536 B\)\) is still held"):
        out["loss"].backward()
    del out
    model.zero_grad(set_to_none=True)
    compiled(x)["loss"].backward()  # dropped: runs
    assert model.a.weight.grad is not None


def test_backend_refuses_an_unknown_outputs_value():
    with pytest.raises(RematError, match='outputs=.logits.*"all".*"loss"'):
        remat.backend(budget="50%", outputs="logits")


def test_backend_loss_only_on_gpt2_keeps_its_layers_and_frees_the_logits(gpt2):
    """The forward's end node has no fx node: the layer finder leaves it outside every
    layer, and the logits are its only reader (GPT-2's backward reads the log-softmax)."""
    import torch._dynamo

    from remat_solvers.layer_structure import OUTSIDE

    case, logits_bytes, _ = gpt2
    torch._dynamo.reset()
    case.model.loss_type = "ForCausalLM"  # the default; unset, transformers warns: a graph break
    be = remat.backend(budget="100%", compiler="eager", outputs="loss")
    torch.compile(case.model, backend=be)(*case.args, **case.kwargs).loss.backward()
    (step,) = be.steps
    problem, names = step.graph_problem.problem, step.graph_problem.value_name
    end = names.index(FORWARD_END)
    assert problem.layers is not None and problem.layers.layer_of[end] == OUTSIDE
    assert sum(problem.nodes[i].out_bytes for i in problem.nodes[end].inputs) == logits_bytes
    case.model.zero_grad(set_to_none=True)
