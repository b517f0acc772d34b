"""`remat fit`: the largest value of one factory argument (batch size, sequence
length) whose plan fits the budget. Exponential search up from `start` (doubling) until
a value does not fit or `maximum` is reached, then binary search between the last value
that fit and the first that did not, so the answer fits and answer + 1 does not (or the
answer is `maximum`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    """One planned value."""

    value: int
    fits: bool
    predicted_peak_bytes: int | None
    """The plan's simulated peak (None when it did not fit)."""
    min_peak_bytes: int | None
    """The smallest reachable peak, when the budget was refused."""
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitResult:
    answer: int | None
    """Largest value that fits; None when even `start` does not."""
    hit_maximum: bool
    probes: tuple[Probe, ...]


def search(probe: Callable[[int], Probe], *, start: int = 1, maximum: int | None = None,
           on_probe: Callable[[Probe], None] | None = None) -> FitResult:
    """Search the largest fitting value; `probe(v)` plans value v."""
    if start < 1 or (maximum is not None and maximum < start):
        raise ValueError(f"need 1 <= start ({start}) <= maximum ({maximum})")
    probes: dict[int, Probe] = {}

    def fits(v: int) -> bool:
        if v not in probes:
            probes[v] = probe(v)
            if on_probe:
                on_probe(probes[v])
        return probes[v].fits

    if not fits(start):
        return FitResult(answer=None, hit_maximum=False, probes=tuple(probes.values()))
    good, bad = start, None
    while bad is None:
        nxt = good * 2 if maximum is None else min(good * 2, maximum)
        if nxt == good:  # at the maximum and it fits
            return FitResult(answer=good, hit_maximum=True, probes=tuple(probes.values()))
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:  # invariant: good fits, bad does not
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return FitResult(answer=good, hit_maximum=False, probes=tuple(probes.values()))


def timed_probe(plan_value: Callable[[int], int], infeasible: type[Exception]) -> Callable[[int], Probe]:
    """A probe from `plan_value(v) -> predicted peak` that raises `infeasible` (with a
    `min_peak_bytes` attribute) when the budget is below every reachable peak."""

    def probe(v: int) -> Probe:
        started = time.perf_counter()
        try:
            peak = plan_value(v)
        except infeasible as e:
            return Probe(value=v, fits=False, predicted_peak_bytes=None,
                         min_peak_bytes=getattr(e, "min_peak_bytes", None), seconds=time.perf_counter() - started)
        return Probe(value=v, fits=True, predicted_peak_bytes=peak, min_peak_bytes=None,
                     seconds=time.perf_counter() - started)

    return probe
