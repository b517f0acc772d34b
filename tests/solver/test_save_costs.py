"""What saving costs (`Node.save_s`, the "compiled-traffic" cost model): simulate charges
it for the saved values the backward reads, the ILP, dp and layers minimize it with the
recompute seconds, and `remat.plan` fills it from the graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat_solvers import Decision, Node, Phase, Problem, Status, builders, simulate, solve

F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT


def _chain_with_save_costs(save_a: float, save_d: float = 0.0, budget: int = 10_000) -> Problem:
    """x -> a -> b -> d (the loss); the backward reads a and b. d is not read by the
    backward (not a decision value); a's saving costs `save_a`."""
    return Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0, save_s=save_a),
            Node(name="b", inputs=(1,), out_bytes=100, phase=F, compute_s=2.0),
            Node(name="d", inputs=(2,), out_bytes=4, phase=F, compute_s=8.0, save_s=save_d),
            Node(name="t", inputs=(), out_bytes=4, phase=B),
            Node(name="gb", inputs=(4, 2), out_bytes=100, phase=B),
            Node(name="ga", inputs=(5, 1), out_bytes=100, phase=B),
        ),
        outputs=(3, 6),
        budget_bytes=budget,
    )


def test_simulate_charges_saving_for_saved_values_the_backward_reads():
    problem = _chain_with_save_costs(save_a=4.0, save_d=16.0)
    saved = simulate(problem, {1: Decision.SAVE, 2: Decision.SAVE})
    assert (saved.recompute_s, saved.save_s, saved.cost_s) == (0.0, 4.0, 4.0)  # d: not saved for backward
    dropped = simulate(problem, {1: Decision.RECOMPUTE, 2: Decision.SAVE})
    assert (dropped.recompute_s, dropped.save_s, dropped.cost_s) == (1.0, 0.0, 1.0)


@pytest.mark.parametrize("solver", ["brute", "ilp", "dp", "auto"])
def test_exact_solvers_recompute_when_saving_costs_more(solver):
    """Everything fits; recomputing a (1.0 s) is cheaper than saving it (4.0 s)."""
    cheap, dear = _chain_with_save_costs(save_a=0.5), _chain_with_save_costs(save_a=4.0)
    assert solve(cheap, solver).decisions[1] is Decision.SAVE
    plan = solve(dear, solver)
    assert plan.decisions[1] is Decision.RECOMPUTE
    assert plan.status is Status.OPTIMAL and plan.objective_s == 1.0 == simulate(dear, plan).cost_s


@pytest.mark.parametrize("solver", ["dp", "layers"])
def test_dp_and_layers_plan_saving_costs_as_the_ilp_does(solver):
    """They take save costs: on a chain (dp) and a layered stack (layers)
    their optimum is the ILP's, and simulate's cost of their plan."""
    from test_layered import stack

    problem = builders.chain(6, budget_bytes=8 << 20) if solver == "dp" else builders.with_budget_fraction(stack(3, 0), 0.9)
    charged = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(n, save_s=(1.0 + i % 3) * max(n.compute_s, 1e-3) / 2)
        if i in problem.needed_ids and n.alias_of is None else n
        for i, n in enumerate(problem.nodes)))
    assert charged.save_charged
    plan, ilp = solve(charged, solver), solve(charged, "ilp")
    assert plan.status is Status.OPTIMAL and ilp.status is Status.OPTIMAL
    assert plan.objective_s == pytest.approx(simulate(charged, plan).cost_s, rel=1e-9)
    if solver == "dp":
        assert plan.objective_s == pytest.approx(ilp.objective_s, rel=1e-6)
    else:  # layers' space keeps the shared mask: never below the ILP's
        assert plan.objective_s >= ilp.objective_s * (1 - 1e-6)


def test_remat_plan_fills_saving_costs_and_stays_bit_exact():
    """A GELU MLP under "compiled-traffic": the saved pointwise values the backward reads
    carry 2 x bytes / bandwidth, the plan's objective is simulate's cost with them, and
    the eager runtime's gradients equal eager's."""
    import remat

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x)))).square().mean()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    planned = remat.plan(model, (x,), budget="100%", cost_model="compiled-traffic")
    problem = planned.problem
    charged = [i for i, n in enumerate(problem.nodes) if n.save_s]
    assert charged and set(charged) <= problem.needed_ids
    speed = remat.frontend.costs.device_speed("cpu")
    for i in charged:
        assert problem.nodes[i].save_s == pytest.approx(2 * problem.nodes[i].out_bytes / speed.bandwidth_bytes_per_s)
    assert planned.plan.objective_s == simulate(problem, planned.plan).cost_s
    loss = planned(x)
    loss.backward()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    ref(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
