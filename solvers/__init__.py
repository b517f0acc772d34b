"""Torch-free rematerialization planning: problem types, the memory model, the solvers.

This package imports numpy, networkx and ortools at most, never torch or remat
(tests/solver/test_torch_free.py enforces it).
"""

from remat_solvers.base import Options
from remat_solvers.problem import (
    Decision,
    Evaluation,
    Node,
    Phase,
    Plan,
    Problem,
    Status,
    Step,
    StepKind,
    decisions_all,
)
from remat_solvers.registry import SOLVERS, SolverSpec, UnsupportedProblem, make_options, register, solve
from remat_solvers.simulate import PlanError, evaluate, simulate
from remat_solvers import _builtin  # noqa: F401  (registers the built-in solvers)

__all__ = [
    "Decision",
    "Evaluation",
    "Node",
    "Options",
    "Phase",
    "Plan",
    "PlanError",
    "Problem",
    "SOLVERS",
    "SolverSpec",
    "Status",
    "Step",
    "UnsupportedProblem",
    "StepKind",
    "decisions_all",
    "evaluate",
    "make_options",
    "register",
    "simulate",
    "solve",
]
