"""One budget for the whole step when `torch.compile` splits it into several graphs.

Dynamo hands a backend several graphs per step when the model has graph breaks, when
DDPOptimizer splits it at bucket boundaries, or when FSDP2 runs hooks between wrapped
modules. They run forward in order and backward in reverse, so while graph k runs, what
the step holds outside it is live too: the tensors earlier graphs saved for their
backward, tensors crossing graph boundaries that eager autograd or the user's frame keep
(the batch, a graph's output a later eager op saved), and the parameters of the other
graphs with their gradients. The ledger measures exactly that when each graph is
called, from the storages it has seen (weak references; each storage once):

- every tensor argument and output of every call, and what each call's autograd node
  saved for backward (`grad_fn.saved_tensors`), while they are alive;
- every parameter argument ever seen, and every gradient they have when the call starts;
- under DDP, its reducer's gradient buckets (`runtime.step.ddp`);
- under FSDP2, what it holds outside every graph (`runtime.step.fsdp`): the sharded
  parameters and gradients, the other groups' unsharded parameters, its collective
  buffers, and a bound on what its hooks allocate around the call;
- the gradients that will appear before the call's backward ends: those of the
  parameters of the calls after it in the step (their backward runs first) that have
  none yet (known from the second step on: the first step cannot see the graphs that
  have not run yet).

First step (learning): nothing is known of the graphs that have not run yet, so each
call is planned under `budget - outside` as measured then (a percentage: of the running
estimate of the whole step's no-remat peak), and a call whose share is below its floor
runs at its floor instead of being refused. When the first step ends, the ledger knows
every call and splits the budget among them (`runtime.step.split`: a percentage is then of
the whole step's predicted no-remat peak). From the second step on, every call runs the
plan of its share; if no split fits, the first call of the step is refused with an
`InfeasibleBudgetError` naming the smallest reachable whole-step peak, before anything
of that step runs. A runtime guard stays: if what is measured outside a call exceeds what
the split predicted, the call takes a plan that fits what is measured, or is refused.

A step ends when a graph is called while no earlier call waits for its backward.
Graphs with symbolic sizes (dynamic shapes) and graphs from torch's compile cache pass
through the backend planned per graph, outside the ledger.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.budget import format_bytes, resolve_budget
from remat.errors import InfeasibleBudgetError
from remat.planning.floor import lowest_found
from remat.runtime.step import split, storages
from remat.runtime.step.ddp import DdpState
from remat.runtime.step.fsdp import FsdpState
from remat_solvers import solve


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """One call of one captured graph within a step, as the ledger saw it."""

    graph: int
    """Which captured graph (its index in the backend's order of capture)."""
    outside_bytes: int
    """Live bytes outside the graph when it was called (measured, see the module doc),
    plus, from the second step, the gradients that appear before its backward ends."""
    pending: tuple[int, ...]
    """Positions of the earlier calls of the step still waiting for their backward."""
    share_bytes: int
    """What its plan was allowed to peak at."""
    peak_bytes: int
    """The predicted peak of the plan it ran (its own bytes)."""
    baseline_bytes: int
    """Its no-remat peak."""
    held_bytes: int
    """What its autograd node saved for backward, beyond parameters (measured)."""
    boundary_bytes: int
    """Its plan's predicted live bytes between forward and backward."""
    no_remat_gap_bytes: int
    """What its no-remat plan would hold beyond its plan (predicted)."""
    params: frozenset[int] = frozenset()
    """Storages (`runtime.step.storages.key`) of its parameter arguments that require grad."""
    with_grad: frozenset[int] = frozenset()
    """Storages of the parameters (any call's) that had a gradient when it started."""
    counted: frozenset[int] = frozenset()
    """Storages of the parameters counted in `outside_bytes` (those seen by then)."""

    @property
    def step_peak_bytes(self) -> int:
        return self.outside_bytes + self.peak_bytes

    def record(self, future_grad_bytes: int) -> split.CallRecord:
        return split.CallRecord(graph=self.graph, outside_bytes=self.outside_bytes + future_grad_bytes,
                                pending=self.pending, held_bytes=self.held_bytes,
                                boundary_bytes=self.boundary_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Seen:
    """What the ledger measured when a call started."""

    outside_bytes: int
    pending: tuple[int, ...]
    params: frozenset[int]
    with_grad: frozenset[int]
    counted: frozenset[int]


class StepLedger:
    """What a backend's graphs hold during one step; one per `RematBackend`."""

    def __init__(self, budget: int | str, *, solver: str = "auto",
                 solver_options: Mapping[str, Any] | None = None) -> None:
        self.budget = budget
        self.solver = solver
        self.solver_options = dict(solver_options or {})
        """The solver's own options (`PlannerSettings.solver_options`), for the split's menus."""
        self.current: list[Call] = []
        self.first_step: tuple[Call, ...] = ()
        self.last_step: tuple[Call, ...] = ()
        self.steps = 0
        """Complete steps seen."""
        self.budget_bytes: int | None = None
        """The whole step's budget in bytes, once the first step is known."""
        self.no_remat_step_bytes: int | None = None
        """The whole step's predicted no-remat peak, once the first step is known."""
        self.shares: tuple[split.Option, ...] | None = None
        """The split: the option each call of the step runs (None: none fits)."""
        self.predicted_step_bytes: int | None = None
        """The split's predicted whole-step peak (of the floors when nothing fits)."""
        self.graphs: dict[int, list[Any]] = {}
        """Captured graph -> the PlannedSteps made for it (the first: its problem, baseline)."""
        # storages are keyed by `storages.key`, an int; every key kept beyond a call is
        # held in a `storages.Watched`, so that no new storage takes its address
        self._tracked = storages.Watched()
        """Non-parameter storages seen (and their bytes), until found dead."""
        self._params: dict[int, weakref.ref] = {}
        """Parameter storages -> the parameter, until either dies."""
        self._param_storages = storages.Watched()
        """Every parameter storage ever seen and its bytes when last seen (never dropped)."""
        self._param_bytes = self._param_storages.bytes
        self._pending: list[tuple[int, list[bool], Any]] = []  # (position, backward done?, watch)
        self._fed_by_grad: set[int] = set()
        """Parameters of graph calls that took a non-parameter argument requiring grad."""
        self.fsdp = FsdpState()
        """FSDP2's sharded state and buffers, outside every graph (`runtime.step.fsdp`)."""
        self.ddp = DdpState()
        """DDP's reducer buckets, outside every graph (`runtime.step.ddp`)."""

    @property
    def knows_the_step(self) -> bool:
        return self.steps > 0

    def begin(self, args: Sequence[Any]) -> Seen:
        """A graph is called with `args`: what is live outside it, after closing the
        previous step when none of its calls is pending."""
        self._pending = [p for p in self._pending if not p[1][0]]
        if not self._pending and self.current:
            self._close_step()
        self.fsdp.discover(args)
        self.ddp.discover(args)
        mine, params, fed_by_grad = set(), set(), False
        known, param_bytes = self._params, self._param_bytes
        for a in args:  # some 20-200 arguments a call: inlined, no call per argument
            if isinstance(a, torch.Tensor):
                storage = a.untyped_storage()
                key = storage._cdata  # storages.key
                mine.add(key)
                if isinstance(a, nn.Parameter):
                    ref = known.get(key)
                    if ref is None or ref() is not a:
                        known[key] = weakref.ref(a)
                    if key in param_bytes:
                        param_bytes[key] = storage.nbytes()
                    else:
                        self._param_storages.watch(storage, storage.nbytes())
                    if a.requires_grad:
                        params.add(key)
                elif a.requires_grad:
                    fed_by_grad = True
        if fed_by_grad:
            self._fed_by_grad |= params
        outside, with_grad = self._live_bytes(exclude=mine)
        if self.fsdp.found:
            outside += self.fsdp.transient_bytes(frozenset().union(*(c.params for c in self.current)))
        outside += self.ddp.bucket_bytes()
        return Seen(outside_bytes=outside, pending=tuple(p[0] for p in self._pending),
                    params=frozenset(params), with_grad=with_grad,
                    counted=frozenset(self._params.keys() - mine))

    def future_grad_bytes(self, position: int) -> int:
        """Gradients that appear while the call at `position` of a known step runs:
        those of the later calls' parameters (their backward runs first) that had none
        when it started in the first step."""
        if position >= len(self.first_step):
            return 0
        call = self.first_step[position]
        later = set().union(*(c.params for c in self.first_step[position + 1:]))
        # FSDP2 reduce-scatters a non-root group's gradients right after its backward when
        # its forward took an input that requires grad (seen as a graph argument with the
        # group's parameters): what remains, the sharded gradient, is in
        # `fsdp.transient_bytes`; any other group's stay until the end of the backward
        later -= self.fsdp.transient_grads() & self._fed_by_grad
        # DDP with gradient_as_bucket_view: a gradient lands in its bucket (counted outside)
        later -= self.ddp.grads_in_buckets()
        return sum(self._param_bytes.get(k, 0) for k in later - call.params - call.with_grad)

    def learning_share(self, outside: int, pending: tuple[int, ...], baseline: int) -> int:
        """First step: the budget (a percentage: of the running no-remat estimate)
        minus what is outside."""
        held_gap = sum(self.current[i].no_remat_gap_bytes for i in pending)
        running = [c.outside_bytes + c.baseline_bytes
                   + sum(self.current[i].no_remat_gap_bytes for i in c.pending) for c in self.current]
        return resolve_budget(self.budget, max(running + [outside + held_gap + baseline])) - outside

    def record(self, outputs: Any) -> int:
        """The call ran: track its outputs and what its autograd node saved (the held
        bytes, returned), and wait for its backward; `add` its `Call` next."""
        outputs = _tensors(outputs)
        self._track(outputs)
        node = next((out.grad_fn for out in outputs if out.grad_fn is not None), None)
        held = 0
        if node is not None:
            saved = [t for t in getattr(node, "saved_tensors", ()) or () if isinstance(t, torch.Tensor)]
            tracked = self._tracked.bytes
            held = sum(map(tracked.__getitem__, self._track(saved)))
            self._wait_for_backward(node, len(self.current))
        return held

    def add(self, call: Call) -> None:
        """The call `record`ed last (built after it: its held bytes are measured then)."""
        self.current.append(call)

    def _wait_for_backward(self, node: Any, position: int) -> None:
        done = [False]

        def finished(*_: Any) -> None:
            done[0] = True

        def backward_ran(*_: Any) -> None:
            # the last backward of the first step: split the budget now, so that a budget
            # no split fits is refused as this step ends, not when the next one starts
            done[0] = True
            self._pending = [p for p in self._pending if not p[1][0]]
            if not self._pending and self.current and not self.knows_the_step:
                self._close_step()
                if self.shares is None:
                    raise self.refusal()

        node.register_hook(backward_ran)
        try:  # a graph dropped without a backward (held by the entry: while it waits)
            dropped = weakref.ref(node, finished)
        except TypeError:  # pragma: no cover - nodes that take no weak references
            dropped = None
        self._pending.append((position, done, dropped))

    def _close_step(self) -> None:
        self.last_step = tuple(self.current)
        self.current = []
        self.steps += 1
        if self.steps == 1:
            self.first_step = self.last_step
            self._split()

    def _unseen_param_bytes(self, call: Call) -> int:
        """Parameters live during a first-step call that it could not count: those of
        graphs that had not run yet (the second step's measurement counts them)."""
        unseen = set(self._params) - call.counted - call.params - self.fsdp.unsharded()
        return sum(self._param_bytes.get(k, 0) for k in unseen if self._param_storages.alive(k))

    def _split(self) -> None:
        records = [c.record(self.future_grad_bytes(i) + self._unseen_param_bytes(c))
                   for i, c in enumerate(self.first_step)]
        save_all = {graph: split.save_all_option(steps[0].graph_problem.problem, steps[0].no_remat_peak_bytes)
                    for graph, steps in self.graphs.items()}
        self.no_remat_step_bytes = split.no_remat_step_bytes(records, save_all)
        self.budget_bytes = resolve_budget(self.budget, self.no_remat_step_bytes)
        ran = [split.Option(budget_bytes=c.share_bytes, peak_bytes=c.peak_bytes,
                            boundary_bytes=c.boundary_bytes, cost_s=0.0) for c in self.first_step]
        peak = max(split.step_peaks(records, ran), default=0)
        if peak <= self.budget_bytes:  # the first step's plans fit: keep them
            self.shares, self.predicted_step_bytes = tuple(ran), peak
        else:
            self.shares, self.predicted_step_bytes = split.allocate(records, self._menus(), self.budget_bytes)

    def _menus(self) -> dict[int, tuple[split.Option, ...]]:
        menus = {}
        for graph, steps in self.graphs.items():
            problem = steps[0].graph_problem.problem
            floor = lowest_found(problem, solve(problem.with_budget(0), self.solver, **self.solver_options))
            menu = split.menu(problem, baseline_bytes=steps[0].baseline_peak_bytes, floor=floor,
                              solver=self.solver, options=self.solver_options,
                              planned=[(s.budget_bytes, s.plan) for s in steps])
            menus[graph] = _under_inductor(menu, steps, problem)
        return menus

    def planned_share(self, position: int, graph: int) -> split.Option | None:
        """The split's option for this call, when the step runs as the first one did."""
        if self.shares is None or position >= len(self.shares) or self.first_step[position].graph != graph:
            return None
        return self.shares[position]

    def refusal(self) -> InfeasibleBudgetError:
        """No split fits: the smallest whole-step peak found (every call at the lowest
        peak its solver and recompute-everything reach; not an exhaustive floor search)."""
        floor = self.predicted_step_bytes or 0
        return InfeasibleBudgetError(
            f"whole-step budget {self.budget!r} ({format_bytes(self.budget_bytes or 0)}) is below the "
            f"smallest reachable peak of the step found, {format_bytes(floor)}, with every one of its "
            f"{len(self.first_step)} graph calls at its floor (what is held outside each graph "
            "counted: earlier graphs' saved activations, tensors crossing graph boundaries, "
            f"parameters and gradients; no-remat step peak {format_bytes(self.no_remat_step_bytes or 0)}); "
            f"raise the budget to at least {floor} bytes, shrink the batch, or use fewer graph breaks",
            budget_bytes=self.budget_bytes or 0, min_peak_bytes=floor,
        )

    def describe(self) -> str:
        """The split, for the backend's summary."""
        calls = self.last_step or tuple(self.current)
        if not calls:
            return ""
        worst = max(calls, key=lambda c: c.step_peak_bytes)
        which = "last complete step" if self.last_step else "first step (still learning the step)"
        known = (f"budget {format_bytes(self.budget_bytes)} of a no-remat step peak "
                 f"{format_bytes(self.no_remat_step_bytes)}; " if self.budget_bytes is not None else "")
        lines = [f"whole-step budget {self.budget!r} shared by {len(calls)} graph calls: {known}"
                 f"predicted step peak {format_bytes(worst.step_peak_bytes)} in the {which} (graph "
                 f"{worst.graph}, with {format_bytes(worst.outside_bytes)} held outside it)"]
        lines += [f"  call {i}: graph {c.graph}: {c.outside_bytes} B outside + plan peak {c.peak_bytes} B "
                  f"(share {c.share_bytes} B, no-remat {c.baseline_bytes} B, holds {c.held_bytes} B)"
                  for i, c in enumerate(calls)]
        return "\n".join(lines)

    def _track(self, tensors: Sequence[torch.Tensor]) -> set[int]:
        """Track the storages of `tensors` at their size now; returns their keys, but
        parameters'. (Some 100 tensors a call: one loop, no call per tensor.)"""
        params, tracked = self._params, self._tracked.bytes
        keys = set()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in params:
                continue
            if key in tracked:
                tracked[key] = storage.nbytes()
            else:  # a new storage: watch it for death
                tracked[storage._weak_ref()] = storage.nbytes()  # Watched.watch, inlined
            keys.add(key)
        return keys

    def _live_bytes(self, *, exclude: set[int]) -> tuple[int, frozenset[int]]:
        """Bytes of the live storages seen, but those in `exclude`, each once; and the
        parameters that have a gradient now."""
        self._tracked.drop_dead()
        params, expired = self._params, storages.expired
        live = []
        for key, ref in params.items():
            param = ref()
            if param is not None and not expired(key):
                live.append((key, param))
        if len(live) < len(params):
            self._params = params = {k: params[k] for k, _ in live}
        counted = {k: n for k, n in self._tracked.bytes.items() if k not in exclude and k not in params}
        with_grad = set()
        in_buckets = self.ddp.grads_in_buckets()  # views of DDP's buckets, counted as buckets
        for key, param in live:  # every key's bytes are its size now: the order is free
            # a parameter's storage at its size now: FSDP2 frees an unsharded parameter's
            # storage (resizes it to 0) between its all-gathers
            if key not in exclude:
                counted[key] = param.untyped_storage().nbytes()
            grad = param.grad
            if grad is not None:
                with_grad.add(key)
                if key not in in_buckets:
                    storage = grad.untyped_storage()
                    counted[storage._cdata] = storage.nbytes()
        # FSDP2's sharded parameters and gradients, unsharded parameters and buffers
        counted.update((k, n) for k, n in self.fsdp.live().items() if k not in exclude)
        return sum(counted.values()), frozenset(with_grad)


def predicted_peak(step: Any) -> int:
    """A plan's predicted peak, with what inductor's fusion adds to it."""
    return step.evaluation.peak_bytes + getattr(step, "fusion_margin_bytes", 0)


def _under_inductor(menu: tuple[split.Option, ...], steps: Sequence[Any], problem: Any) -> tuple[split.Option, ...]:
    """A graph's menu (op by op) as inductor runs it: the no-remat option at the no-remat
    peak inductor's code holds, the plans compiled at the peaks estimated for them under
    inductor, and every other option raised by the largest margin the compiled plans
    showed (`fusion_margin_bytes`; 0 off inductor), never lowered: where inductor's code
    holds less than remat's model on the plans compiled, that room belongs to those plans
    (MLP tiny: -114,432 B on its floor plan under inductor, which would put its op-by-op
    floor at 650,072 B, below any plan inductor runs). So a whole-step percentage and the
    split's floors are of the same path that runs, and the floor named is reachable."""
    margin = max(0, *(s.fusion_margin_bytes for s in steps))
    baseline, no_remat = steps[0].baseline_peak_bytes, steps[0].no_remat_peak_bytes
    if not any(s.fusion_margin_bytes for s in steps) and no_remat == baseline:
        return menu
    raised = [dataclasses.replace(o, peak_bytes=no_remat if o.cost_s == 0 and o.peak_bytes == baseline
                                  else o.peak_bytes + margin) for o in menu]
    compiled = [split.Option(budget_bytes=s.budget_bytes, peak_bytes=predicted_peak(s),
                             boundary_bytes=split.boundary_bytes(problem, s.plan), cost_s=s.evaluation.cost_s)
                for s in steps if s.fusion_graph_bytes]  # estimated under inductor
    return split.frontier(raised + compiled)


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [o for o in outputs if isinstance(o, torch.Tensor)]
    return []


Compile = Callable[[Sequence[Any], Callable[[int], int] | None, bool], tuple[Callable[..., Any], Any]]
"""(args, budget_for(baseline) or None, best_effort) -> (compiled callable, PlannedStep or None)."""
