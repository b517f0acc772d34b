"""`remat.plan(model, args, budget=...)`: the public front door.

It traces the model's training step, plans it under the budget, rewrites it, and
returns a `Planned` module that shares the model's parameters and buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from remat import costs
from remat.budget import check_budget_syntax, format_bytes, resolve_budget
from remat.errors import InfeasibleBudgetError, RematError, UnknownSolverError
from remat.problem import GraphProblem, build_problem
from remat.rewrite import partition
from remat.trace import FlatModel, FlatSignature, compile_joint
from solvers import SOLVERS, Decision, Evaluation, Plan, Status, decisions_all, simulate, solve

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanTimings:
    """Seconds spent in each stage of planning."""

    trace_s: float
    profile_s: float
    solve_s: float
    rewrite_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedStep:
    """Everything remat decided for one input signature."""

    graph_problem: GraphProblem
    plan: Plan
    evaluation: Evaluation
    baseline_peak_bytes: int
    budget_bytes: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    timings: PlanTimings
    library_trace_path: str = ""
    """Why the model was traced on its library's compile path (see `trace.Traced`), or ''."""


class _Partitioner:
    """AOTAutograd's partition_fn: plan the joint graph, return fw/bw modules."""

    def __init__(self, *, num_params: int, budget: int | str, solver: str, options: dict[str, Any],
                 started_s: float) -> None:
        self.num_params = num_params
        self.budget = budget
        self.solver = solver
        self.options = options
        self.started_s = started_s
        self.step: PlannedStep | None = None
        self.error: RematError | None = None

    def __call__(self, joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                 **_: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        try:
            return self._partition(joint, num_fwd_outputs)
        except RematError as e:  # AOTAutograd may wrap exceptions; keep ours to re-raise
            self.error = e
            raise

    def _partition(self, joint: fx.GraphModule, num_fwd_outputs: int):
        t_traced = time.perf_counter()
        speed = costs.device_speed("cpu")
        gp = build_problem(joint, num_fwd_outputs=num_fwd_outputs, num_params=self.num_params,
                           budget_bytes=0, cost_s=lambda node: costs.node_cost_s(node, speed))
        baseline = simulate(gp.problem, decisions_all(gp.problem, Decision.SAVE)).peak_bytes
        budget_bytes = resolve_budget(self.budget, baseline)
        gp = dataclasses.replace(gp, problem=gp.problem.with_budget(budget_bytes))
        t_profiled = time.perf_counter()
        plan = solve(gp.problem, self.solver, **self.options)
        if plan.status is Status.INFEASIBLE:
            raise _infeasible(gp, plan, budget_bytes, baseline)
        t_solved = time.perf_counter()
        evaluation = simulate(gp.problem, plan)
        fw, bw = partition(joint, gp, plan, evaluation, num_fwd_outputs=num_fwd_outputs)
        t_done = time.perf_counter()
        self.step = PlannedStep(
            graph_problem=gp, plan=plan, evaluation=evaluation, baseline_peak_bytes=baseline,
            budget_bytes=budget_bytes, forward=fw, backward=bw,
            timings=PlanTimings(trace_s=t_traced - self.started_s, profile_s=t_profiled - t_traced,
                                solve_s=t_solved - t_profiled, rewrite_s=t_done - t_solved),
        )
        return fw, bw


def _infeasible(gp: GraphProblem, plan: Plan, budget_bytes: int, baseline: int) -> InfeasibleBudgetError:
    """The error for a budget below every reachable peak, with the smallest one."""
    reach = min(
        [plan.peak_bytes]
        + [solve(gp.problem.with_budget(0), s).peak_bytes for s in ("all", "chen-greedy")]
    )
    return InfeasibleBudgetError(
        f"budget {format_bytes(budget_bytes)} is below the smallest reachable peak "
        f"{format_bytes(reach)} for this model and input shapes (no-remat peak "
        f"{format_bytes(baseline)}); raise the budget to at least {reach} bytes or shrink "
        "the batch",
        budget_bytes=budget_bytes, min_peak_bytes=reach,
    )


class Planned(nn.Module):
    """The model, rematerialized. Shares the model's parameters, buffers and submodules
    (same `state_dict()` keys, same Parameter objects), so optimizers and checkpoints
    work unchanged. Calling it runs the planned forward; `.loss.backward()` runs the
    planned backward. Other input shapes are re-planned under the same budget."""

    def __init__(self, model: nn.Module, *, budget: int | str, solver: str, options: dict[str, Any]):
        super().__init__()
        # Share, don't wrap: the same dicts, so keys and objects are the model's own.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.__dict__["_remat_model"] = model
        self.__dict__["_remat_cache"] = {}
        self.budget = budget
        self.solver = solver
        self.options = dict(options)
        self.training = model.training

    @property
    def model(self) -> nn.Module:
        return self.__dict__["_remat_model"]

    def train(self, mode: bool = True) -> "Planned":
        self.model.train(mode)
        self.training = mode
        return self

    def prepare(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[PlannedStep, Any, FlatModel]:
        """Plan (or fetch the cached plan) for these inputs' signature."""
        signature = FlatSignature.of(args, kwargs, self.model.training)
        cache = self.__dict__["_remat_cache"]
        if signature.key not in cache:
            if cache:
                log.info("remat: new input signature %s; re-planning under the same budget", signature.key[2])
            cache[signature.key] = self._compile(signature, args, kwargs)
        return cache[signature.key]

    def _compile(self, signature: FlatSignature, args: Sequence[Any], kwargs: dict[str, Any]):
        started = time.perf_counter()
        flat = FlatModel(self.model, signature)
        num_params = len(dict(flat.named_parameters(remove_duplicate=False))) + len(
            dict(flat.named_buffers(remove_duplicate=False)))
        # Re-plans keep the bytes the first plan resolved: the device does not grow.
        cache = self.__dict__["_remat_cache"]
        budget = next(iter(cache.values()))[0].budget_bytes if cache else self.budget
        partitioner = _Partitioner(num_params=num_params, budget=budget, solver=self.solver,
                                   options=self.options, started_s=started)
        try:
            traced = compile_joint(flat, signature.tensors(args, kwargs), partitioner, user_model=self.model)
        except Exception:
            if partitioner.error is not None:
                raise partitioner.error from None
            raise
        if partitioner.step is None:
            raise RematError(
                "AOTAutograd did not produce a joint graph (does the loss require grad? are "
                "gradients enabled?); call the model under torch.enable_grad() with trainable "
                "parameters"
            )
        step = dataclasses.replace(partitioner.step, library_trace_path=traced.library_trace_path)
        return step, traced.compiled, flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.model(*args, **kwargs)  # nothing to rematerialize without backward
        signature = FlatSignature.of(args, kwargs, self.model.training)
        _, compiled, flat = self.prepare(args, kwargs)
        outs = compiled(*signature.tensors(args, kwargs))
        return flat.unflatten(outs)

    # ---- what was decided, for the signature planned first ----

    @property
    def step(self) -> PlannedStep:
        cache = self.__dict__["_remat_cache"]
        if not cache:
            raise RematError("nothing planned yet: call remat.plan(model, args, budget=...)")
        return next(iter(cache.values()))[0]

    @property
    def plan(self) -> Plan:
        return self.step.plan

    @property
    def problem(self):
        return self.step.graph_problem.problem

    @property
    def predicted_peak_bytes(self) -> int:
        return self.step.evaluation.peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.step.baseline_peak_bytes

    @property
    def budget_bytes(self) -> int:
        return self.step.budget_bytes

    def summary(self) -> str:
        from remat.report import summary

        return summary(self.step)


def plan(
    model: nn.Module,
    args: Sequence[Any] | Any,
    kwargs: dict[str, Any] | None = None,
    *,
    budget: int | str,
    solver: str = "auto",
    **options: Any,
) -> Planned:
    """Plan `model`'s training step on these example inputs under `budget`.

    budget: int bytes, a string with units ('800MB', '1.5GiB'), or a percentage of the
    no-remat peak ('60%'); it covers the whole forward+backward step. Raises
    `InfeasibleBudgetError` (a RematError) if no plan fits, stating the smallest peak."""
    if not isinstance(model, nn.Module):
        raise RematError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if solver not in SOLVERS:
        raise UnknownSolverError(f"unknown solver {solver!r}; valid solvers: {sorted(SOLVERS)}")
    check_budget_syntax(budget)  # fail before tracing, not after
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    planned = Planned(model, budget=budget, solver=solver, options=options)
    with torch.enable_grad():
        planned.prepare(tuple(args), kwargs)
    return planned
