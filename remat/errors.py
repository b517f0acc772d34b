"""The one error hierarchy: every failure a user can act on is a RematError."""

from __future__ import annotations

from typing import Any


class RematError(Exception):
    """Base of every error remat raises on purpose."""


class BudgetError(RematError, ValueError):
    """A budget that cannot be parsed or resolved to bytes."""


class UnknownSolverError(RematError, ValueError):
    """A solver name that is not registered; the message lists the valid ones."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget; `min_peak_bytes` is the smallest reachable peak and
    `min_peak_plan` (a `remat_solvers.Plan`, when known) the plan that reaches it: planning at
    exactly `min_peak_bytes` succeeds, and `remat.plan(..., hint=error.min_peak_plan)`
    starts from it."""

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int,
                 min_peak_plan: Any = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.min_peak_plan = min_peak_plan


class TraceError(RematError):
    """The model could not be traced into a joint forward+backward graph."""


class UnsupportedGraphError(RematError):
    """The traced graph holds something remat cannot plan (named in the message)."""


class CompositionError(RematError):
    """remat composed with a distributed wrapper (FSDP, DDP, process groups) in a way
    that cannot work; the message names the composition that does."""


class UnsupportedTorchError(RematError, ImportError):
    """The installed torch lacks an API a feature of remat needs (`remat.compat`); the
    message names the feature, the API and the torch versions that have it. An
    ImportError too: the feature's import fails, the rest of remat keeps working."""
