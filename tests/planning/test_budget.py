"""Budget strings to bytes: units are exact powers of 1000 / 1024; bad forms say what is accepted."""

import pytest

from remat import BudgetError, resolve_budget
from remat.budget import format_bytes


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (123, 123),
        ("800MB", 800_000_000),
        ("800 MB", 800_000_000),
        ("1.5GiB", 1_610_612_736),
        ("2KiB", 2048),
        ("3kb", 3000),
        ("7B", 7),
        ("64", 64),
        ("60%", 600),
        ("12.5%", 125),
    ],
)
def test_resolve(budget, expected):
    assert resolve_budget(budget, baseline_peak_bytes=1000) == expected


@pytest.mark.parametrize("budget", ["lots", "5 parsecs", "MB", "%", "-3MB", "0", 0, -1, True, 1.5, None, [1]])
def test_bad_budget_names_value_and_forms(budget):
    with pytest.raises(BudgetError) as info:
        resolve_budget(budget, baseline_peak_bytes=1000)
    message = str(info.value)
    assert repr(budget) in message or str(budget) in message
    if isinstance(budget, str) and budget not in ("-3MB", "0"):
        assert "KiB" in message and "%" in message


def test_format_bytes():
    assert format_bytes(3 * 2**20) == "3.00 MiB (3145728 B)"


def test_percentage_that_rounds_to_zero_bytes_is_a_budget_error():
    with pytest.raises(BudgetError, match=r"'0.001%' resolves to 0 bytes"):
        resolve_budget("0.001%", baseline_peak_bytes=1000)
