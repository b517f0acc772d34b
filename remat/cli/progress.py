"""A progress display for the CLI that appears only when a stage runs longer than
`delay_s` (about 2 s): quick commands print nothing extra. Uses rich when installed and
stderr is a terminal; `quiet=True` turns it off."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

from remat import partitioner


class Stages:
    """`with stages.stage("trace + solve"): ...`; `stage` yields an `advance(done, total)`.
    `with stages.planning(verbose)` follows the planner's own stages (trace, profile,
    solve, rewrite) from its debug records."""

    def __init__(self, *, quiet: bool = False, delay_s: float = 2.0) -> None:
        self.delay_s = delay_s
        self.enabled = not quiet and sys.stderr.isatty() and _has_rich()
        self.log: list[tuple[str, float]] = []
        """(stage, seconds) for every finished stage."""
        self.planner_stages: tuple[str, ...] = ()
        """The planner stages the last `planning()` saw, in order."""
        self.planner_log: list[tuple[str, float]] = []
        """(planner stage, seconds) for each planner stage of the last `planning()`, in
        order (a refused budget planned again at the floor shows each stage twice); the
        bar shows them beside the stage that runs."""

    @contextlib.contextmanager
    def stage(self, description: str) -> Iterator[Callable[[int, int], None]]:
        started = time.perf_counter()
        display = _Delayed(description, self.delay_s) if self.enabled else None
        try:
            yield display.advance if display else (lambda done, total: None)
        finally:
            if display:
                display.close()
            self.log.append((description, time.perf_counter() - started))


    @contextlib.contextmanager
    def planning(self, verbose: bool = False) -> Iterator[None]:
        """A stage for `remat.plan` whose description follows the planner: a filter on
        the `remat.partitioner` logger reads each record's stage (and drops the record
        unless `verbose`, so nothing else prints)."""
        with self.stage("tracing") as advance:
            display = getattr(advance, "__self__", None)
            seen: list[str] = []
            current = ["trace", time.perf_counter()]  # the stage that runs, since when
            self.planner_log = []

            def on_record(record: logging.LogRecord) -> bool:
                stage = getattr(record, partitioner.STAGE, None)
                if stage is None:
                    return True
                seen.append(stage)
                now = time.perf_counter()
                if stage != current[0]:  # a stage ends where the next begins
                    self.planner_log.append((current[0], now - current[1]))
                    current[:] = [stage, now]
                if display is not None:
                    done = ", ".join(f"{name} {s:.1f} s" for name, s in self.planner_log)
                    text = record.getMessage().removeprefix("remat: ")
                    display.describe(f"{text} ({done})" if done else text)
                return verbose

            level = partitioner.log.level
            partitioner.log.addFilter(on_record)
            partitioner.log.setLevel(logging.DEBUG)
            try:
                yield
            finally:
                partitioner.log.removeFilter(on_record)
                partitioner.log.setLevel(level)
                self.planner_stages = tuple(seen)
                self.planner_log.append((current[0], time.perf_counter() - current[1]))


def _has_rich() -> bool:
    try:  # on use: only a terminal gets the display, and rich may be missing
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


class _Delayed:
    """A rich progress bar started by a timer thread after `delay_s`, unless closed first."""

    def __init__(self, description: str, delay_s: float) -> None:
        # rich loads with the first display (a stage on a terminal), not with the CLI
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.lock = threading.Lock()
        self.started = self.closed = False
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
        self.task = self.progress.add_task(f"remat: {description}", total=None)
        self.timer = threading.Timer(delay_s, self._start)
        self.timer.daemon = True
        self.timer.start()

    def _start(self) -> None:
        with self.lock:
            if not self.closed:
                self.progress.start()
                self.started = True

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=f"remat: {text}")

    def advance(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)

    def close(self) -> None:
        self.timer.cancel()
        with self.lock:
            self.closed = True
            if self.started:
                self.progress.stop()
