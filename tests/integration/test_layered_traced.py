"""Repeated layers found in traced joint graphs (nn_module_stack), and `layers` plans of
zoo models trained end to end: gradients equal eager's bit for bit, the measured peak
stays under the budget."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; never download

import pytest
import torch

import remat
from remat.testing import zoo
from remat.testing.measure import measure_step
from remat_solvers import Decision, Phase, Status
from remat_solvers.layer_structure import OUTSIDE
from nets import grad_copies


@functools.lru_cache(maxsize=None)  # each (model, budget, solver) traced and planned once per session
def _planned(name: str, budget: str, solver: str) -> tuple[zoo.ModelCase, remat.Planned]:
    case = zoo.build(name)
    return case, remat.plan(case.model, case.args, case.kwargs, budget=budget, solver=solver)


@pytest.mark.parametrize("name,prefix,shared", [
    ("gpt2", "transformer.h.", True),  # the causal mask, built once, read by every layer
    ("llama", "model.layers.", True),  # the mask and the rotary cos/sin tables
    ("cnn", "blocks.", False),
])
def test_layers_are_found_from_the_module_stack(name, prefix, shared):
    case, planned = _planned(name, "100%", "none")
    layers = planned.problem.layers
    assert layers is not None
    assert layers.names == tuple(f"{prefix}{k}" for k in range(len(case.blocks)))
    problem = planned.problem
    for i, k in enumerate(layers.layer_of):  # only forward nodes carry a layer
        assert k == OUTSIDE or problem.nodes[i].phase is Phase.FORWARD
    segments = layers.segments()
    assert len(segments) == len(case.blocks)
    assert all(a[1] < b[0] for a, b in zip(segments, segments[1:]))
    assert bool(layers.shared_values(problem)) is shared


def _grads_and_peak(model, case: zoo.ModelCase) -> tuple[dict[str, torch.Tensor], int]:
    for p in case.model.parameters():
        p.grad = None

    def step():
        torch.manual_seed(0)
        out = model(*case.args, **case.kwargs)
        out.loss.backward()
        return out

    peak = measure_step(step, register=(case.model, *case.args, *case.kwargs.values())).peak_bytes
    return grad_copies(case.model), peak


def test_layers_plan_trains_like_eager_under_its_budget():
    case, planned = _planned("cnn", "75%", "layers")
    plan = planned.plan
    assert plan.solver == "layers" and plan.status is Status.OPTIMAL
    assert plan.lower_bound_s == plan.objective_s
    assert plan.count(Decision.RECOMPUTE) > 0
    planned_grads, peak = _grads_and_peak(planned, case)
    eager_grads, _ = _grads_and_peak(case.model, case)
    for n, g in eager_grads.items():
        assert torch.equal(planned_grads[n], g), n
    assert peak <= planned.budget_bytes


def test_auto_uses_layers_when_the_front_end_finds_them():
    _, planned = _planned("cnn", "75%", "auto")
    _, layered = _planned("cnn", "75%", "layers")
    assert planned.plan.status is Status.OPTIMAL
    assert planned.plan.decisions == layered.plan.decisions


def test_fused_attention_without_dropout_is_recomputed_bit_for_bit():
    """`_scaled_dot_product_flash_attention_for_cpu` is tagged nondeterministic_seeded for
    its dropout; with dropout_p=0 (LLaMA) it draws nothing, so a plan may recompute it."""
    from torch._export.utils import _compiling_state_context

    case, planned = _planned("llama", "100%", "all")
    gp = planned.step.graph_problem
    attention = [i for i, names in enumerate(gp.fx_names)
                 if any(n.startswith("_scaled_dot_product_flash_attention_for_cpu") and "backward" not in n
                        for n in names)]
    assert attention and set(attention) <= set(planned.step.evaluation.recomputed_ids)
    planned_grads, peak = _grads_and_peak(planned, case)
    with _compiling_state_context():  # the code path remat traced (explicit causal mask)
        eager_grads, _ = _grads_and_peak(case.model, case)
    for n, g in eager_grads.items():
        assert torch.equal(planned_grads[n], g), n


def test_llama_stack_splits_into_blocks_per_layer():
    """The reduced LLaMA graph is a block sequence with an attention and an MLP block per
    layer: the RMSNorm backward reads its input (a block boundary) before its rsqrt."""
    from remat_solvers.dp.structure import analyze
    from remat_solvers.layers import _behind, fold_views, kept_values

    case, planned = _planned("llama", "100%", "none")
    problem = planned.problem
    kept = kept_values(problem)
    red = fold_views(problem, kept)
    seq = analyze(red.problem, fixed=_behind(red.problem, frozenset(red.reduced_id(v) for v in kept)))
    assert len(seq.blocks) >= 2 * len(case.blocks)


@functools.lru_cache(maxsize=None)
def _gpt2_traffic(fraction: float):
    """GPT-2 (tiny) traced under "compiled-traffic" with the loss as its only output, at
    `fraction` of its no-remat peak."""
    from remat_solvers import decisions_all, simulate

    case = zoo.build("gpt2", size="tiny")
    problem = remat.plan(case.model, case.args, dict(case.kwargs), budget="100%", solver="none",
                         cost_model="compiled-traffic", outputs="loss").problem
    assert problem.save_charged and problem.layers is not None
    full = simulate(problem, decisions_all(problem, Decision.SAVE)).peak_bytes
    return problem.with_budget(int(full * fraction))


@pytest.mark.parametrize("fraction", [0.9, 0.6])
def test_layers_plans_gpt2_under_compiled_traffic_as_the_ilp_does(fraction):
    """GPT-2 (tiny) under "compiled-traffic" (saving a pointwise value the backward reads
    costs its traffic): layers finds the ILP's optimum
    (at 60% with saved pointwise values charged), and its objective is simulate's."""
    from remat_solvers import simulate, solve

    problem = _gpt2_traffic(fraction)
    plan, ilp = solve(problem, "layers"), solve(problem, "ilp")
    ev = simulate(problem, plan)
    assert plan.status is Status.OPTIMAL and ilp.status is Status.OPTIMAL
    assert plan.objective_s == pytest.approx(ev.cost_s, rel=1e-9)
    assert plan.objective_s <= ilp.objective_s * (1 + 1e-6)
    assert plan.objective_s == pytest.approx(ilp.objective_s, rel=1e-6)
    assert (ev.save_s > 0) is (fraction < 0.75)


def test_auto_plans_traced_gpt2_with_layers_at_its_default_limit():
    """auto's defaults admit `layers` on a traced GPT-2: its 57,600-configuration attention
    block is under layers_max_block_configs, and the tables' deterministic charge (about
    3 nominal s; TABLE_STEPS_PER_S, calibrated on ~2.5 cpu s of building them cold) is
    under default_time_limit_s. At WORK_STEPS_PER_S the same tables would charge ~23 s
    and auto would fall back to the ILP."""
    from remat_solvers import solve
    from remat_solvers.auto import AutoOptions

    problem = _gpt2_traffic(0.6)
    plan, layers = solve(problem, "auto"), solve(problem, "layers")
    assert layers.solver == "layers" and plan.solver == "auto"
    assert plan.decisions == layers.decisions and plan.work_s == layers.work_s
    assert plan.status is layers.status and plan.lower_bound_s == layers.lower_bound_s
    assert 2.0 < layers.work_s < 4.0 < AutoOptions().default_time_limit_s
