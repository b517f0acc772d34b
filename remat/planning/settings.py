"""The planner's settings: one frozen record per entry point, built and checked in one place.

`remat.plan` builds it with `PlannerSettings.for_eager`, `remat.backend` with
`PlannerSettings.for_backend`; each constructor holds its path's defaults and runs
`check_settings`, so both entry points refuse the same bad values with the same words.
`remat.partitioner.Partitioner` plans every graph of that entry point with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from remat.budget import check_budget_syntax
from remat.errors import RematError, UnknownSolverError
from remat.frontend.costs import COST_MODELS, DeviceSpeed
from remat.offload.costing import check_offload
from remat_solvers import SOLVERS

OUTPUTS = ("all", "loss")
"""Values of `outputs=` (`remat.plan`, `remat.backend`): "all" holds every output until the
step ends; "loss" keeps only the loss past the forward."""

PLANNER_OPTIONS = ("measure_workspace", "replay_rng", "schedules", "floor_if_refused")
"""Keyword options of `remat.plan`/`remat.backend` that the planner reads itself; every other
keyword option goes to the solver (`PlannerSettings.solver_options`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerSettings:
    """What `remat.partitioner.Partitioner` plans every graph of one `remat.plan` or
    `remat.backend` with. What varies per graph (the budget the closed loop sets again,
    the ledger's share, the offload link of the graph's device) is the Partitioner's."""

    budget: int | str
    """As the user gave it: bytes, a string with units, or a percentage of the no-remat
    peak (`remat.budget.resolve_budget`); it covers the whole forward+backward step."""
    solver: str = "auto"
    """A name in `remat_solvers.SOLVERS`."""
    solver_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The solver's own keyword options (`time_limit_s`, `seed`, ...), read-only: the
    keyword options of the entry point other than `PLANNER_OPTIONS`."""
    cost_model: str = "eager"
    """How a recompute's seconds are estimated, one of `remat.frontend.costs.COST_MODELS`."""
    offload: bool | str = "auto"
    """Whether activations may go to host memory: True, False, "auto" (on CUDA only) or
    "fallback" (only where the recompute-only plan does not fit)."""
    custom_offload_ops: bool = False
    """Inductor compiles the result: offload through custom ops, reloads not prefetched
    (they wait in place there; remat/offload/ops.py)."""
    sync_ranks: bool | None = None
    """Take rank 0's plan on every rank (`remat.planning.distributed`); None: when a process group
    of more than one rank is initialized."""
    device_speed: DeviceSpeed | None = None
    """Roofline figures for per-op costs. None: measure this machine (outside any fake
    mode); fake-tensor planning passes a named device's figures, since nothing may run
    there."""
    sum_gradients_in_place: bool = False
    """Run a parameter's gradient sum in place into one operand, as eager autograd does
    (`remat.frontend.accumulate`); for the eager runtime (inductor does its own buffer
    reuse)."""
    drop_outputs: bool = False
    """The caller drops every forward output but the loss before backward
    (`remat.backend(outputs="loss")`): they are held to the forward's end only. False
    under `remat.plan`, whose trace with outputs="loss" has the loss as its only output
    (`remat.frontend.trace.FlatModel`)."""
    replay_rng: bool = False
    """Random ops may be recomputed from a saved generator state
    (`remat.frontend.random_ops`); else they are always saved. The eager runtime replays
    them; inductor's partitioner hook does not get them (its graphs keep the random ops
    as they are)."""
    schedules: bool = False
    """Below every canonical plan, try plans that recompute a value more than once
    (`remat.planning.floor`); the eager runtime runs them (remat/runtime/schedule.py)."""
    floor_if_refused: bool = False
    """Below the smallest reachable peak, plan at that peak instead of raising, and keep
    the refusal in `PlannedStep.refusal` (`remat report`: "no" is an answer, reported for
    the floor's plan from the one trace). The eager path's option; a refusal still
    raises everywhere else."""
    measure_workspace: bool = True
    """Count each op's workspace measured on the device (`remat.frontend.workspace`): the
    budget is what the allocator serves, and kernel scratch no tensor holds is part of it
    (without it the tiny cnn of `remat/testing/zoo.py` at 100% reads 10.7% over the prediction
    with the allocator, a ResNet 24%: bench/README.md, "The budget as the allocator
    counts it"). Planning with `device_speed` given (fake) assumes every workspace is 0:
    nothing may run there."""
    inline_pointwise: bool = False
    """Solve against the graph as inductor's lowering runs it: a pointwise value read by
    one pointwise or reduction op holds no bytes, and its inputs live until that op
    (`remat.planning.inlining`). Inductor's closed loop sets it for one of the plans it
    tries at the floor (`remat.runtime.inductor.closed_loop`); the prediction is still
    inductor's generated code against the plain graph."""
    descend_floor: bool = True
    """The floor search ends with a descent that lowers the floor's peak, then its cost,
    op by op (`remat_solvers.least_peak.descend`). Inductor's closed loop also tries a
    floor without it (`remat.runtime.inductor.closed_loop`): the descent never raises the
    peak op by op, but inductor's code for the descended plan can hold more (ViT tiny,
    the floor with schedules solved as inductor inlines: 1,338,532 B as generated
    descended, 1,265,636 B not)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "solver_options", MappingProxyType(dict(self.solver_options)))

    @property
    def measures_workspace(self) -> bool:
        """Whether plans count each op's measured workspace: asked, and not planning fake."""
        return self.measure_workspace and self.device_speed is None

    @classmethod
    def for_eager(cls, *, budget: int | str, solver: str = "auto", options: Mapping[str, Any] | None = None,
                  sync_ranks: bool | None = None, offload: bool | str = "auto",
                  device_speed: DeviceSpeed | None = None, compile: bool = False,
                  cost_model: str | None = None, outputs: str = "all") -> PlannerSettings:
        """`remat.plan`'s settings (its arguments of the same names; `options` are its
        other keyword options). Schedules that recompute a value twice are planned unless
        an option says otherwise; the eager runtime replays random ops, `compile=True`
        keeps them saved (inductor draws its own random numbers). `outputs` is checked
        here and applied by the trace."""
        cost_model = "eager" if cost_model is None else cost_model
        check_settings(budget=budget, solver=solver, offload=offload, cost_model=cost_model, outputs=outputs)
        solver_options, planner = _split(options)
        return cls(budget=budget, solver=solver, solver_options=solver_options, cost_model=cost_model,
                   offload=offload, sync_ranks=sync_ranks, device_speed=device_speed,
                   sum_gradients_in_place=True,
                   replay_rng=bool(planner.get("replay_rng", not compile)),
                   schedules=bool(planner.get("schedules", True)),
                   floor_if_refused=bool(planner.get("floor_if_refused", False)),
                   measure_workspace=_asked(planner.get("measure_workspace")))

    @classmethod
    def for_backend(cls, *, budget: int | str, solver: str = "auto", options: Mapping[str, Any] | None = None,
                    sync_ranks: bool | None = None, offload: bool | str = "auto",
                    compiler: str = "inductor", cost_model: str | None = None,
                    outputs: str = "all") -> PlannerSettings:
        """`remat.backend`'s settings (its arguments of the same names; `options` are its
        other keyword options). Under inductor (`compiler="inductor"`) the default cost
        model prices fusion ("compiled-traffic") and offload goes through custom ops.
        Schedules that recompute a value twice are planned (the `schedules` option turns
        them off): the backward is a plain graph with one copy of the value per
        recompute, which inductor compiles like any other and the closed loop measures
        as generated. `replay_rng` is the eager runtime's option (it replays the
        generator): the backend's graphs keep every random op saved, whatever it says.
        Under inductor a dropout mask is not one: it is `prims.inductor_random`, drawn
        from a seed the forward draws once (`prims.inductor_seeds`, the random op kept
        saved), so it may be recomputed and draws the same numbers."""
        cost_model = cost_model or ("compiled-traffic" if compiler == "inductor" else "eager")
        check_settings(budget=budget, solver=solver, offload=offload, cost_model=cost_model, outputs=outputs)
        solver_options, planner = _split(options)
        return cls(budget=budget, solver=solver, solver_options=solver_options, cost_model=cost_model,
                   offload=offload, sync_ranks=sync_ranks, custom_offload_ops=compiler == "inductor",
                   drop_outputs=outputs == "loss", schedules=bool(planner.get("schedules", True)),
                   measure_workspace=_asked(planner.get("measure_workspace")))


class SettingsView:
    """The user-facing settings of an entry point's `settings`, read-only (`Planned`,
    `RematBackend`)."""

    settings: PlannerSettings

    @property
    def budget(self) -> int | str:
        return self.settings.budget

    @property
    def solver(self) -> str:
        return self.settings.solver

    @property
    def sync_ranks(self) -> bool | None:
        return self.settings.sync_ranks

    @property
    def offload(self) -> bool | str:
        return self.settings.offload


def check_settings(*, budget: Any, solver: Any, offload: Any, cost_model: Any, outputs: Any) -> None:
    """Refuse a bad setting before anything is traced, naming the argument and the valid
    values (a `RematError`)."""
    if solver not in SOLVERS:
        raise UnknownSolverError(f"unknown solver {solver!r}; valid solvers: {sorted(SOLVERS)}")
    check_budget_syntax(budget)
    check_offload(offload)
    if cost_model not in COST_MODELS:
        raise RematError(f"unknown cost_model={cost_model!r}; valid cost models: {list(COST_MODELS)}")
    if outputs not in OUTPUTS:
        raise RematError(f"unknown outputs={outputs!r}: use \"all\" (every output held until the step "
                         "ends) or \"loss\" (only the loss is kept past the forward)")


def _split(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The solver's options and the planner's (`PLANNER_OPTIONS`) among the keyword options."""
    options = dict(options or {})
    planner = {k: options.pop(k) for k in PLANNER_OPTIONS if k in options}
    return options, planner


def _asked(measure_workspace: bool | None) -> bool:
    """The `measure_workspace` option: None (not given) measures, as True does."""
    return True if measure_workspace is None else bool(measure_workspace)


__all__ = ["OUTPUTS", "PLANNER_OPTIONS", "PlannerSettings", "check_settings"]
