"""A planned module under tools that hook modules: remat runs its fx graphs with
`gm.forward`, so global module hooks (FlopCounterMode's module tracker, profilers, users'
hooks) see the user's modules, never remat's graphs inside AOTAutograd's Function."""

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.frontend import costs
from nets import Tower


def _flops(fn, x):
    with FlopCounterMode(display=False) as counter:
        fn(x).backward()
    return counter.get_total_flops()


def test_flop_counter_mode_counts_a_planned_step_exactly():
    torch.manual_seed(0)
    model, x = Tower(d=32, depth=6), torch.randn(512, 32)
    eager = copy.deepcopy(model)
    planned = remat.plan(model, (x,), budget="80%", solver="chen-greedy")
    step = planned.step
    recomputed = {step.graph_problem.value_name[i] for i in step.evaluation.recomputed_ids}
    assert recomputed
    extra = sum(costs.node_flops(n) for n in step.backward.graph.nodes if n.name in recomputed)
    assert extra > 0  # the plan recomputes at least one matmul
    assert _flops(planned, x) == _flops(eager, x) + extra


def test_global_module_hooks_see_the_users_modules_only():
    torch.manual_seed(0)
    model, x = Tower(d=32, depth=6), torch.randn(64, 32)
    planned = remat.plan(model, (x,), budget="90%", solver="chen-greedy")
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        planned(x).backward()
    finally:
        handle.remove()
    assert seen == ["Planned"]
    own = []
    planned.register_forward_hook(lambda m, a, o: own.append(o.detach()))
    loss = planned(x)
    assert len(own) == 1 and torch.equal(own[0], loss.detach())
