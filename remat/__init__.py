"""remat: graph-level activation rematerialization for PyTorch training.

    planned = remat.plan(model, args, budget="60%")
    planned(*args).loss.backward()
"""

from remat.api import Planned, plan
from remat.budget import resolve_budget
from remat.compile_backend import RematBackend, backend
from remat.errors import (
    BudgetError,
    CompositionError,
    InfeasibleBudgetError,
    RematError,
    TraceError,
    UnknownSolverError,
    UnsupportedGraphError,
    UnsupportedTorchError,
)

__all__ = [
    "BudgetError",
    "CompositionError",
    "InfeasibleBudgetError",
    "Planned",
    "RematBackend",
    "RematError",
    "TraceError",
    "backend",
    "UnknownSolverError",
    "UnsupportedGraphError",
    "UnsupportedTorchError",
    "plan",
    "resolve_budget",
]
