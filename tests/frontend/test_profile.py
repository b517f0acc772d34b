"""Per-node facts of the joint graph: never-replay flags, aliasing, multi-output ops."""

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat.frontend.profile import never_replay_reason
from remat_solvers import Phase


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _reasons(gm):
    return {n.target.__name__: never_replay_reason(n) for n in gm.graph.nodes if n.op == "call_function"
            and hasattr(n.target, "_schema")}


def test_random_and_mutating_ops_are_never_replayed():
    gm = _graph(lambda x: (torch.bernoulli(x), torch.native_dropout(x, 0.5, True)[0], x.add_(1), x.relu()),
                torch.rand(4))
    reasons = _reasons(gm)
    assert reasons["bernoulli.default"] == "random"
    assert reasons["native_dropout.default"] == "random"
    assert reasons["add_.Tensor"] == "mutating"
    assert reasons["relu.default"] is None


def test_problem_models_views_and_multi_output_ops():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            h = self.ln(x).view(8, 4, 4).transpose(1, 2).reshape(8, 16)
            return self.lin(torch.relu(h)).sum()

    planned = remat.plan(M(), (torch.randn(8, 16),), budget="100%", solver="none")
    gp = planned.step.graph_problem
    nodes = gp.problem.nodes
    by_name = {n.name: i for i, n in enumerate(nodes)}
    # native_layer_norm's first output carries the op; mean and rstd read it and are
    # never replayed alone
    ln_out = next(i for i, names in enumerate(gp.fx_names) if names[0].startswith("native_layer_norm"))
    assert nodes[ln_out].compute_s > 0 and nodes[ln_out].recomputable
    secondary = [i for i, n in enumerate(nodes) if ln_out in n.inputs and not n.recomputable]
    assert len(secondary) == 2 and all(nodes[i].out_bytes == 8 * 4 for i in secondary)
    # the view of the layer-norm output aliases its storage and costs nothing
    view = next(i for i, n in enumerate(nodes) if n.alias_of == ln_out)
    assert nodes[view].compute_s == 0.0
    assert nodes[by_name["primals_1"]].phase is Phase.PARAM
    assert sum(n.phase is Phase.INPUT for n in nodes) == 1
