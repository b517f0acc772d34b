"""Budget strings and numbers to bytes: 800MB, 1.5GiB, 60%, or an int."""

from __future__ import annotations

import re

from remat.errors import BudgetError

_UNITS = {
    "": 1, "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
ACCEPTED = (
    "an int number of bytes; a string with a unit: B, KB/MB/GB/TB (powers of 1000) or "
    "KiB/MiB/GiB/TiB (powers of 1024), e.g. '800MB' or '1.5GiB'; or a percentage of the "
    "no-remat peak, e.g. '60%'"
)


def resolve_budget(budget: int | str, baseline_peak_bytes: int) -> int:
    """The budget in bytes; percentages are of `baseline_peak_bytes`."""
    if isinstance(budget, bool):
        raise BudgetError(f"budget={budget!r} is a bool; give {ACCEPTED}")
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"budget={budget} bytes must be positive")
        return budget
    if isinstance(budget, float):
        raise BudgetError(
            f"budget={budget!r} is a float; give bytes as an int or a string, e.g. "
            f"{int(budget)} or '{budget * 100:g}%'"
        )
    if not isinstance(budget, str):
        raise BudgetError(f"budget={budget!r} has type {type(budget).__name__}; give {ACCEPTED}")
    match = _PATTERN.match(budget)
    unit = match.group(2).upper() if match else None
    if match is None or (unit not in _UNITS and unit != "%"):
        raise BudgetError(f"cannot parse budget={budget!r}; give {ACCEPTED}")
    value = float(match.group(1))
    if value <= 0:
        raise BudgetError(f"budget={budget!r} must be positive")
    resolved = int(baseline_peak_bytes * value / 100.0) if unit == "%" else int(value * _UNITS[unit])
    if resolved <= 0:
        raise BudgetError(f"budget={budget!r} resolves to {resolved} bytes; it must be at least 1 byte")
    return resolved


def is_percentage(budget: int | str) -> bool:
    """Whether `budget` is a percentage of the no-remat peak ('60%')."""
    match = _PATTERN.match(budget) if isinstance(budget, str) else None
    return match is not None and match.group(2) == "%"


def check_budget_syntax(budget: int | str) -> None:
    """Raise BudgetError for a malformed budget, before any tracing happens."""
    resolve_budget(budget, baseline_peak_bytes=2**62)


def format_bytes(n: int) -> str:
    """`12345678` -> '11.77 MiB (12345678 B)'."""
    return f"{n / 2**20:.2f} MiB ({n} B)"
