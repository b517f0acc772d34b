"""`auto`: pick a solver by the problem's size and structure (the one place that decides).

The choice, in order:
  1. no decision values, or at most `brute_max` of them: `brute` (exhaustive, exact, a
     few milliseconds);
  2. repeated layers found by the front end (Problem.layers) whose blocks are small
     enough: `layers` (exact over its plan space, in which the few values shared
     between layers, such as a causal mask, are kept; lower_bound_s is over that space);
     it gets `time_limit_s` (default `default_time_limit_s`) for its block tables; not
     tried at budget 0, where no plan fits;
  3. a chain or a sequence of blocks (dp.structure.analyze succeeds) whose blocks are
     small enough: `dp` (exact, seconds even at 10,000 nodes);
  4. otherwise `ilp` under `time_limit_s` (default 10 s): OPTIMAL, or FEASIBLE with a
     lower bound; it is warm-started from the best heuristic plan, so it is never worse
     than `chen-greedy`;
  5. if `ilp` is not available (OR-Tools missing) or raises UnsupportedProblem:
     `chen-greedy`.
A solver that raises UnsupportedProblem hands over to the next one. The returned plan
keeps the chosen solver's status and bound but is labelled "auto".
"""

from __future__ import annotations

import dataclasses
import logging
import time

from collections.abc import Mapping

from remat_solvers.base import Options, finish, hint_decisions
from remat_solvers.problem import Decision, Plan, Problem, Status
from remat_solvers.simulate import PlanError, evaluate
from remat_solvers.registry import SOLVERS, UnsupportedProblem, make_options

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoOptions(Options):
    """Options of `auto`; time_limit_s, seed and workers are passed on to the chosen
    solver (time_limit_s defaults to `default_time_limit_s` for `ilp`)."""

    brute_max: int = 12
    """Largest number of decision values solved by exhaustive enumeration."""
    default_time_limit_s: float = 10.0
    """Time limit given to `ilp` and `layers` when time_limit_s is None (deterministic
    seconds)."""
    layers_max_block_configs: int = 1 << 17
    """max_block_configs given to `layers` (its own default): admits the traced GPT-2
    and LLaMA attention blocks (57,600 and 95,040 configurations), whose tables build
    cold inside default_time_limit_s at TABLE_STEPS_PER_S (bench/README.md, "The
    tables' clock", from `bench/depth.py --solve-only`)."""
    hint: Mapping[int, Decision] | Plan | None = None
    """A plan to start from (passed to `ilp` as its warm start); the returned plan is
    never worse than it: it fits if the hint does, and costs no more (or, when nothing
    fits, peaks no higher)."""


def choose(problem: Problem, options: AutoOptions) -> list[str]:
    """The solvers `auto` tries, in order."""
    order = []
    if len(problem.decision_ids) <= options.brute_max:
        order.append("brute")
    if problem.layers is not None and problem.budget_bytes > 0:
        # at budget 0 (the floor search's query) nothing fits, and auto never returns
        # layers' least peak over its narrower space: its tables would be built for nothing
        order.append("layers")
    order += ["dp", "ilp", "chen-greedy"]
    return [name for name in order if name in SOLVERS]


def _no_worse_than(problem: Problem, plan: Plan, hint: Mapping[int, Decision]) -> Plan:
    """`plan`, or the hint where the hint is better (fits when the plan does not, is
    cheaper, or peaks lower when neither fits)."""
    try:
        ev = evaluate(problem, hint_decisions(hint))
    except PlanError:  # a plan of another graph: nothing to compare
        log.warning("auto: the hint does not decide this problem's values; ignored")
        return plan
    if ev.fits:
        better = plan.status is Status.INFEASIBLE or ev.cost_s < plan.objective_s
    else:
        better = plan.status is Status.INFEASIBLE and ev.peak_bytes < plan.peak_bytes
    if not better:
        return plan
    return finish(problem, hint_decisions(hint), plan.solver, started_s=time.perf_counter() - plan.solve_s,
                  work_s=plan.work_s)


def solve_auto(problem: Problem, options: Options) -> Plan:
    started = time.perf_counter()
    opts = options if isinstance(options, AutoOptions) else AutoOptions(
        time_limit_s=options.time_limit_s, seed=options.seed, workers=options.workers)
    for name in choose(problem, opts):
        limit = opts.time_limit_s
        if limit is None and name in ("ilp", "layers"):
            limit = opts.default_time_limit_s
        passed = {"seed": opts.seed, "workers": opts.workers, "time_limit_s": limit}
        if name == "ilp" and opts.hint is not None:
            passed["hint"] = opts.hint
        if name == "layers":  # its least peak would be dropped below: not searched
            passed.update(max_block_configs=opts.layers_max_block_configs, least_peak=False)
        try:
            plan = SOLVERS[name].run(problem, make_options(name, **passed))
        except UnsupportedProblem as error:
            log.info("auto: %s declined: %s", name, error)
            continue
        if name == "layers" and plan.status is Status.INFEASIBLE:
            continue  # its smallest peak is over its narrower space: let the next solver say
        if opts.hint is not None:
            plan = _no_worse_than(problem, plan, opts.hint)
        return dataclasses.replace(plan, solver="auto", solve_s=time.perf_counter() - started)
    raise UnsupportedProblem("auto: no registered solver accepted the problem")
