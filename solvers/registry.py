"""The one front door: `solve(problem, solver, **options)` and the `SOLVERS` registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

from remat_solvers.base import Options
from remat_solvers.problem import Plan, Problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverSpec:
    """A registered solver."""

    name: str
    run: Callable[[Problem, Options], Plan]
    options_type: type[Options]
    exact: bool
    """True if an OPTIMAL status is a proof over the solver's whole plan space."""
    summary: str


class UnsupportedProblem(ValueError):
    """A solver was asked to plan a problem whose structure it cannot handle
    (e.g. `dp` on a graph that is not a chain or a sequence of blocks). The message says
    why and which solver to use instead. Never raised for an impossible budget.
    `work_s`: deterministic seconds spent before declining (a caller sharing its limit
    subtracts them)."""

    def __init__(self, message: str, *, work_s: float = 0.0) -> None:
        super().__init__(message)
        self.work_s = work_s


_REGISTRY: dict[str, SolverSpec] = {}
SOLVERS: Mapping[str, SolverSpec] = MappingProxyType(_REGISTRY)


def register(spec: SolverSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"solver {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def make_options(solver: str, **options: object) -> Options:
    """Build the solver's options, rejecting unknown fields by name."""
    spec = get(solver)
    fields = {f.name for f in dataclasses.fields(spec.options_type)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(
            f"solver {solver!r} has no option(s) {unknown}; valid options: {sorted(fields)}"
        )
    return spec.options_type(**options)


def get(solver: str) -> SolverSpec:
    if solver not in _REGISTRY:
        raise ValueError(f"unknown solver {solver!r}; valid solvers: {sorted(_REGISTRY)}")
    return _REGISTRY[solver]


def solve(problem: Problem, solver: str = "auto", **options: object) -> Plan:
    """Plan `problem` under its `budget_bytes` with the named solver.

    Never raises for an impossible budget: the plan's status is INFEASIBLE and its
    `peak_bytes` the smallest peak the solver reached."""
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a remat_solvers.Problem, got {type(problem).__name__}")
    spec = get(solver)
    return spec.run(problem, make_options(solver, **options))
