"""remat as a `torch.compile` backend: plan every captured graph under the budget.

    backend = remat.backend(budget="60%")
    compiled = torch.compile(model, backend=backend)
    compiled(x).loss.backward()
    backend.steps  # one PlannedStep per graph dynamo captured

Each graph dynamo hands over is traced by AOTAutograd and partitioned by remat's
planner, exactly as `remat.plan` does; the forward and backward modules run eagerly.
The budget is a promise per captured graph: a model that compiles to one graph
(`fullgraph=True`) gets the same guarantee as `remat.plan`. Unlike `remat.plan`, every
differentiable output of the graph gets a gradient input (dynamo's graph does not know
which output is the loss), which the plan accounts for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from remat.budget import check_budget_syntax
from remat.errors import RematError, UnknownSolverError
from remat.frontend.trace import boxed_eager_compiler
from remat.planner import Partitioner, PlannedStep
from remat.report import summary
from solvers import SOLVERS


class RematBackend:
    """A callable `torch.compile` backend that records what it planned."""

    def __init__(self, *, budget: int | str, solver: str = "auto", sync_ranks: bool | None = None,
                 **options: Any) -> None:
        if solver not in SOLVERS:
            raise UnknownSolverError(f"unknown solver {solver!r}; valid solvers: {sorted(SOLVERS)}")
        check_budget_syntax(budget)
        self.budget = budget
        self.solver = solver
        self.options = dict(options)
        self.sync_ranks = sync_ranks
        self.steps: list[PlannedStep] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import aot_module_simplified

        num_params = len(dict(gm.named_parameters(remove_duplicate=False))) + len(
            dict(gm.named_buffers(remove_duplicate=False)))
        partitioner = Partitioner(num_params=num_params, budget=self.budget, solver=self.solver,
                                   options=self.options, started_s=time.perf_counter(),
                                   sync_ranks=self.sync_ranks)
        try:
            compiled = aot_module_simplified(
                gm, list(example_inputs), fw_compiler=boxed_eager_compiler,
                bw_compiler=boxed_eager_compiler, partition_fn=partitioner,
            )
        except Exception:
            if partitioner.error is not None:
                raise partitioner.error from None
            raise
        if partitioner.step is not None:
            self.steps.append(partitioner.step)
        return compiled

    def summary(self) -> str:
        if not self.steps:
            raise RematError("nothing planned yet: run the compiled model under autograd first")
        return "\n\n".join(summary(step) for step in self.steps)


def backend(*, budget: int | str, solver: str = "auto", sync_ranks: bool | None = None,
            **options: Any) -> RematBackend:
    """A `torch.compile` backend that rematerializes each captured graph under `budget`.
    sync_ranks: as in `remat.plan` (rank 0's plan on every rank)."""
    return RematBackend(budget=budget, solver=solver, sync_ranks=sync_ranks, **options)


__all__ = ["RematBackend", "backend"]
