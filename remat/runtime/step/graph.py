"""The callable a `remat.backend` returns to dynamo for one captured graph, when the
budget is the whole step's (`runtime.step.ledger`): at every call it measures what is held
outside the graph and runs the plan ("variant") the step's split gives this call,
planning it on first use. One graph called at several points of a step (FSDP2's layer
graph, once per layer) may run a different variant at each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from remat.budget import format_bytes
from remat.compat import FakeTensor
from remat.errors import InfeasibleBudgetError
from remat.runtime import dropped
from remat.runtime.step import split
from remat.runtime.step.ledger import Call, Compile, StepLedger, predicted_peak

Variant = tuple[Callable[..., Any], Any]  # (compiled callable, PlannedStep)


class LedgeredGraph:
    def __init__(self, graph: int, ledger: StepLedger, compile: Compile,
                 on_step: Callable[[Any], None], *, drop_outputs: bool = False) -> None:
        self.graph = graph
        self.drop_outputs = drop_outputs
        """The caller drops every output but the loss before backward
        (`PlannerSettings.drop_outputs`): check at backward that they are gone
        (`remat.runtime.dropped`)."""
        self.ledger = ledger
        self._compile = compile
        self._on_step = on_step
        self.variants: list[Variant] = []
        self._save_all_boundary: int | None = None
        self._boundaries: dict[int, int] = {}  # id(PlannedStep) -> its boundary bytes

    def start(self, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Plan the first variant at compile time; returns what dynamo should call.
        Fake example inputs (DDPOptimizer compiles its buckets on fake tensors) cannot be
        measured: that plan is a guess that the first real call corrects."""
        fake = any(isinstance(a, FakeTensor) for a in example_inputs)
        outside, pending = 0, ()
        if not fake:
            seen = self.ledger.begin(example_inputs)
            outside, pending = seen.outside_bytes, seen.pending
        compiled, step = self._plan(example_inputs, self._learning(outside, pending), strict=False)
        if step is None:  # nothing planned (a cache hit, an inference graph): run it as is
            return compiled
        return self

    def __call__(self, *call_args: Any) -> Any:
        # boxed (one list, which the callee may clear) or not: dynamo calls either way
        boxed = len(call_args) == 1 and isinstance(call_args[0], list)
        args = call_args[0] if boxed else call_args
        if any(isinstance(a, FakeTensor) for a in args):
            # DDPOptimizer runs each compiled bucket once on fake tensors at compile time
            # (for its output strides): no memory, nothing for the ledger
            return self.variants[0][0](*call_args)
        seen = self.ledger.begin(args)
        # from the second step: plus the gradients that appear before its backward ends
        outside = seen.outside_bytes + (self.ledger.future_grad_bytes(len(self.ledger.current))
                                        if self.ledger.knows_the_step else 0)
        (compiled, step), share = self._choose(args, outside, seen.pending)
        out = compiled(*call_args)
        held = self.ledger.record(out)
        boundary = self._boundary(step)
        self.ledger.add(Call(graph=self.graph, outside_bytes=outside, pending=seen.pending, share_bytes=share,
                             peak_bytes=predicted_peak(step), baseline_bytes=step.no_remat_peak_bytes,
                             held_bytes=held, boundary_bytes=boundary,
                             no_remat_gap_bytes=max(0, self._no_remat_boundary(step) - boundary),
                             params=seen.params, with_grad=seen.with_grad, counted=seen.counted))
        if self.drop_outputs:
            dropped.watch(out, self.graph)
        return out

    def __getattr__(self, name: str) -> Any:
        # what AOTAutograd's callable carries besides the call (zero_grad, serialize, ...)
        if name.startswith("__") or not self.__dict__.get("variants"):
            raise AttributeError(name)
        return getattr(self.variants[0][0], name)

    def _choose(self, args: Sequence[Any], outside: int, pending: tuple[int, ...]) -> tuple[Variant, int]:
        ledger = self.ledger
        if not ledger.knows_the_step:
            share = ledger.learning_share(outside, pending, self.variants[0][1].no_remat_peak_bytes)
            fits = self._fitting(share)
            if fits is not None:
                return fits, share
            floors = [v for v in self.variants if predicted_peak(v[1]) > v[1].budget_bytes]
            if floors:  # already at its floor: no plan of this graph peaks lower
                return min(floors, key=lambda v: predicted_peak(v[1])), share
            return self._plan(args, self._learning(outside, pending), strict=False), share
        if ledger.shares is None:
            raise ledger.refusal()
        limit = ledger.budget_bytes - outside
        option = ledger.planned_share(len(ledger.current), self.graph)
        if option is not None:
            # a plan it has that peaks and holds no more than the option does keeps every
            # call of the split under the budget too, without a compile
            planned = [v for v in self.variants if predicted_peak(v[1]) <= option.peak_bytes
                       and self._boundary(v[1]) <= option.boundary_bytes]
            variant = (min(planned, key=lambda v: v[1].evaluation.cost_s) if planned else
                       self._plan(args, lambda _: option.budget_bytes, strict=True, outside=outside))
            if predicted_peak(variant[1]) <= limit:
                return variant, option.budget_bytes
        # more is held outside than the split predicted (or a call the first step did not
        # make): a plan that fits what is measured, or a refusal
        fits = self._fitting(limit)
        if fits is not None:
            return fits, limit
        return self._plan(args, lambda _: max(1, limit), strict=True, outside=outside), limit

    def _fitting(self, share: int) -> Variant | None:
        fits = [v for v in self.variants if predicted_peak(v[1]) <= share]
        return min(fits, key=lambda v: (v[1].evaluation.cost_s, -predicted_peak(v[1]))) if fits else None

    def _learning(self, outside: int, pending: tuple[int, ...]) -> Callable[[int], int]:
        return lambda baseline: max(1, self.ledger.learning_share(outside, pending, baseline))

    def _plan(self, args: Sequence[Any], budget_for: Callable[[int], int], *, strict: bool,
              outside: int = 0) -> Variant:
        try:
            compiled, step = self._compile(list(args), budget_for, not strict)
        except InfeasibleBudgetError as e:
            if not outside:  # nothing held outside: the planner's own refusal says it all
                raise
            raise self._refusal(e, outside) from None
        if step is not None:
            self.variants.append((compiled, step))
            self.ledger.graphs.setdefault(self.graph, []).append(step)
            self._on_step(step)
        return compiled, step

    def _refusal(self, error: InfeasibleBudgetError, outside: int) -> InfeasibleBudgetError:
        need = outside + error.min_peak_bytes
        position = len(self.ledger.current)
        return InfeasibleBudgetError(
            f"whole-step budget {self.ledger.budget!r}: when graph {self.graph} runs (call {position} "
            f"of the step), {format_bytes(outside)} are live outside it (earlier graphs' saved "
            "activations, tensors crossing graph boundaries, other graphs' parameters and "
            f"gradients), leaving {format_bytes(error.budget_bytes)}, below its smallest reachable "
            f"peak {format_bytes(error.min_peak_bytes)}; raise the budget to at least {need} bytes, "
            "shrink the batch, or use fewer graph breaks",
            budget_bytes=outside + error.budget_bytes, min_peak_bytes=need,
            min_peak_plan=error.min_peak_plan,
        )

    def _boundary(self, step: Any) -> int:
        """`split.boundary_bytes` of a variant's plan, simulated once: every call needs it,
        and a simulate per call cost LLaMA tiny about 9 ms a step (a third of its compiled
        step time) on 1 CPU thread."""
        key = id(step)  # self.variants holds every step, so an id is never reused
        if key not in self._boundaries:
            self._boundaries[key] = split.boundary_bytes(step.graph_problem.problem, step.plan)
        return self._boundaries[key]

    def _no_remat_boundary(self, step: Any) -> int:
        if self._save_all_boundary is None:
            option = split.save_all_option(step.graph_problem.problem, step.no_remat_peak_bytes)
            self._save_all_boundary = option.boundary_bytes
        return self._save_all_boundary
