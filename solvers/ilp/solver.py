"""`ilp`: CP-SAT over simulate's canonical plan space, certified by simulate.

Plan space: exactly brute's and dp's: every decision value SAVE / RECOMPUTE / OFFLOAD
where allowed, run by simulate's canonical schedule (no explicit schedule is returned).

Formulation (model.py): per value the decision booleans save/drop/off; need, rec,
reload (brought back, recomputed, reloaded in backward); fn (first need) and lr (last
read) as integers in node-step time; one interval per storage (forward, recompute,
reload) with its bytes, and a Cumulative constraint with the static bytes under the
budget. The cost (sum of compute_s over recomputed values plus transfer seconds) is
exact; memory is exact at every node step and unchecked at the recomputation steps
between backward nodes, so the model is a relaxation of simulate. Hence the loop:
solve; simulate the solution; if it fits it is the answer (OPTIMAL when CP-SAT proved
the relaxation optimal: the relaxation's optimum is then a plan), else forbid exactly
that plan (a no-good) and solve again. Any CP-SAT bound is a valid lower bound.

Lower bound by row generation (before that loop, `rows_share` of the time): the knapsack
rows alone (model.py: per node step, the bytes every plan must hold there) are a far
faster relaxation; its optimum is simulated, and at each node step where it overflows
the row is strengthened, then solved again. A strengthened row also counts the values
that a chain of recomputations of any depth brought back by its step, and saved values
a later recomputation still reads (both through exact "brought back by t" literals); on
chains it equals simulate's live bytes at every node step. Each optimum is a valid
bound; one that fits is an optimal plan. This is what certifies transformer joint
graphs: GPT-2 small (774 nodes, 340 values), 10 s limit, one worker: OPTIMAL in about
5 s at 50% and 70% of the no-remat peak (bench/README.md, "Solvers on the zoo's joint
graphs").

Why CP-SAT rather than a MIP (SCIP/CBC through pywraplp): the memory constraint is a
cumulative of intervals whose ends are maxima of integer times, which CP-SAT propagates
natively; a MIP needs the time-indexed form (`bench/solvers.py --backends` builds the
same node-step model that way, for problems without views or offload). With a 30 s
limit and no warm start both agree on every optimum, CP-SAT proves chain(60) and
random_dag(40) over 20x faster than SCIP or CBC, and on random_dag(80) CP-SAT proves the
70% budget while SCIP finds no solution and CBC only a worse one.

The search is warm-started from the best fitting plan of `warm_start` (dp, greedy,
chen-greedy, within a share of the time limit); the returned plan is never worse. When
dp applies and proves its plan OPTIMAL (dp is exact over this same plan space), that
plan is returned as OPTIMAL at once: dp's proof is the certificate (dp exploits the
repeated identical blocks of a stack: one table per distinct layer). A `hint` plan
joins the warm start. Deterministic by default (workers=1, seed): every limit is
deterministic work (`base.WorkClock`; model building, hints and CP-SAT calls charged by
counts, clock.py), never the wall clock, so the same problem gives the same plan under
any machine load.
Cost rounding: costs are scaled by a power of two to integers (dyadic costs stay exact;
others round by at most 2**-24 of the largest cost per value), so OPTIMAL holds up to
that rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from ortools.sat.python import cp_model

from remat_solvers import greedy
from remat_solvers.base import Options, WorkClock, finish, hint_decisions
from remat_solvers.ilp import clock as cost
from remat_solvers.ilp.model import CanonicalModel
from remat_solvers.problem import Decision, Plan, Problem, Status, StepKind, decisions_all
from remat_solvers.registry import SOLVERS, UnsupportedProblem, make_options
from remat_solvers.simulate import PlanError, evaluate

log = logging.getLogger(__name__)
_NODE_STEPS = (StepKind.FORWARD, StepKind.BACKWARD)

LARGE_MODEL_VALUES = 1000
"""Above this many decision values CP-SAT's presolve probing is switched off."""
LP_LEVEL2_VALUES = 500
"""Up to this many decision values CP-SAT's LP holds every constraint (see _solver)."""
ROWS_PER_ROUND = 2
"""Node steps strengthened per round of row generation (the worst overflows first).
Fewer rows make each round's solve cheaper, so more rounds (and more repaired plans) fit
in the limit; of 1, 2, 3, 4 and 8 rows a round, 2 gives the least summed objective at
10 s on the GPT-2 bench points that stay FEASIBLE (bench/README.md, "The ILP's clock")."""
MIN_PEAK_SEARCH_S = 0.05
"""Least time left for the smallest-peak search to run when the budget cannot be met."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ILPOptions(Options):
    """Options of `ilp`."""

    time_limit_s: float | None = 10.0
    """Limit for the whole solve (warm start, model building, hints, CP-SAT calls,
    simulations) in nominal seconds of deterministic work (`base.WorkClock`; CP-SAT's
    calls by what they report, clock.py), so that a solve cut by its limit returns the
    same plan under any machine load. A model or a call the time left cannot pay for is
    not built or made: the best plan so far is returned."""
    warm_start: tuple[str, ...] = ("dp", "chen-greedy", "greedy")
    """Solvers whose best fitting plan seeds the search, in this order while the warm
    share of the time lasts (unknown or unsupported ones are skipped)."""
    warm_share: float = 0.3
    """Largest share of the time limit the warm start may use."""
    max_cuts: int = 1000
    """Most no-good cuts (solutions that simulate rejects) before stopping."""
    least_peak_stall: int = 8
    """When no plan fits: the smallest-peak search stops after this many model solutions
    in a row that do not lower the simulated peak. Each such solution is one plan the
    min-peak model under-counts (its peak lies inside a recomputation run), forbidden by
    a no-good that excludes that plan alone, so without it the loop enumerates plans of
    equal peak until the time limit: of 12 random compositions whose search ran to its
    limit, 11 had their last lower peak at the first solution (bench/README.md, "The
    floor search"; `least_peak.descend` then recovers the twelfth)."""
    rows_share: float = 0.8
    """Share of the time left after the warm start given to row generation (the lower
    bound; on transformer joint graphs what proves a plan optimal); 0 skips it. 0.8
    rather than 0.6: at 10 s it proves more GPT-2 and LLaMA bench points OPTIMAL and moves
    the others by at most 4% of their objective (bench/README.md, "The ILP's clock")."""
    least_peak_share: float = 0.3
    """When no warm-start plan fits, the share of the time left after the warm start
    kept for the smallest-peak search (so that an impossible budget still gets its
    floor searched, not just the warm start's)."""
    hint: Mapping[int, Decision] | Plan | None = None
    """A plan (or its decisions for every decision value) to start from: the returned plan
    fits if it does and is never costlier (never peaks higher, when nothing fits).
    `InfeasibleBudgetError.min_peak_plan` is one."""


def solve_ilp(problem: Problem, options: Options) -> Plan:
    started = time.perf_counter()
    opts = options if isinstance(options, ILPOptions) else ILPOptions(
        time_limit_s=options.time_limit_s, seed=options.seed, workers=options.workers)
    clock = WorkClock(opts.time_limit_s)
    if not problem.decision_ids:
        return finish(problem, {}, "ilp", started_s=started, optimal=True, lower_bound_s=0.0)
    incumbent, smallest, certified = warm_start(problem, opts, clock, opts.warm_share * clock.limit_s)
    if certified:  # an exact solver proved it optimal over this same plan space
        return finish(problem, incumbent[1], "ilp", started_s=started, optimal=True,
                      lower_bound_s=incumbent[0], work_s=clock.spent_s)
    # Nothing fits yet: keep time back for the smallest-peak search.
    reserve_s = opts.least_peak_share * max(0.0, clock.left_s) if incumbent is None else 0.0
    if not cost.charge_build(problem, clock, clock.left_s - reserve_s):  # the limit cannot pay for the model
        return _answer(problem, opts, clock, started, incumbent, smallest)
    model = CanonicalModel(problem, cumulative=False)
    rows_until = clock.spent_s + opts.rows_share * max(0.0, clock.left_s - reserve_s)
    bound_s, exact, incumbent = _generate_rows(model, opts, clock, rows_until, incumbent)
    if exact is not None:  # the relaxation's optimum fits: it is optimal
        if incumbent is not None and incumbent[0] < bound_s:  # equal up to cost rounding: keep the warm start
            exact, bound_s = incumbent[1], incumbent[0]
        return finish(problem, exact, "ilp", started_s=started, optimal=True, lower_bound_s=bound_s,
                      work_s=clock.spent_s)
    model.add_cumulative()  # the full model, keeping the rows generated above
    if incumbent is not None:  # hints stay in the model; no-goods add no variables
        cost.hint(model, incumbent[1], clock)
        reserve_s = 0.0  # a repaired relaxation fits: no smallest-peak search to keep time for
    proven, cuts = False, 0
    while cuts <= opts.max_cuts:
        remaining = clock.left_s - reserve_s
        if not cost.affords_call(model, clock, remaining):
            break
        solver = _solver(opts, remaining * cost.det_per_s(model), len(problem.decision_ids))
        status = cost.run(solver, model, clock)
        if status == cp_model.INFEASIBLE:
            # Every fitting plan satisfies the relaxation and no cut: none fits.
            if incumbent is not None:
                log.warning("ilp: the model is infeasible but plan of cost %.6g fits", incumbent[0])
            break
        if status == cp_model.UNKNOWN:  # its limit came first: again while time is left (clock.det_per_s)
            continue
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        bound_s = max(bound_s, _lower_bound(solver, model))
        decisions = model.decisions_of(solver)
        ev = _simulate(problem, decisions, clock)
        if ev is not None and ev.fits:
            if incumbent is None or ev.cost_s < incumbent[0]:
                incumbent = (ev.cost_s, decisions)
            proven = status == cp_model.OPTIMAL
            break
        model.forbid(decisions)
        cuts += 1
    return _answer(problem, opts, clock, started, incumbent, smallest, bound_s, proven)


def _answer(problem: Problem, opts: ILPOptions, clock: WorkClock, started: float, incumbent, smallest,
            bound_s: float = 0.0, proven: bool = False) -> Plan:
    """The incumbent (cost, decisions) as the plan, or the smallest peak when none fits."""
    if incumbent is None:
        least = _least_peak(problem, opts, clock, smallest)
        return finish(problem, least, "ilp", started_s=started, work_s=clock.spent_s)
    cost_s, decisions = incumbent
    if proven:
        bound_s = cost_s
    return finish(problem, decisions, "ilp", started_s=started, optimal=proven,
                  lower_bound_s=min(bound_s, cost_s), work_s=clock.spent_s)


def _generate_rows(rows: CanonicalModel, opts: ILPOptions, clock: WorkClock, until_s: float, incumbent):
    """Row generation for the lower bound: solve the knapsack rows alone (no cumulative;
    fast), simulate the optimum, and where it overflows at a node step add that step's
    strengthened row (CanonicalModel.strengthen), then solve again. Every row holds for
    every plan, so each optimum is a lower bound; one that fits is an optimal plan.
    `rows` is a model built without the cumulative; the main loop then adds it, so the
    strengthened rows stay in the full model. It runs until `clock` has spent `until_s`.
    An optimum that overflows (or the best plan found when the limit cut a solve) is also
    repaired into a fitting plan (`greedy.repair`), which replaces `incumbent` (cost,
    decisions) when cheaper: at tight budgets that is
    far better than what the main search finds in the same time (GPT-2 bench at 83.31
    MiB, compiled-traffic, 10 s: 9.57e-3 s against 1.278e-2).
    Returns (bound_s, that plan or None, incumbent)."""
    bound_s = 0.0
    problem, d = rows.problem, rows.data
    while cost.affords_call(rows, clock, remaining := until_s - clock.spent_s):
        if incumbent is not None:
            cost.hint(rows, incumbent[1], clock)
        solver = _solver(opts, remaining * cost.det_per_s(rows), len(problem.decision_ids), search=False)
        status = cost.run(solver, rows, clock)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        bound_s = max(bound_s, _lower_bound(solver, rows))
        decisions = rows.decisions_of(solver)
        ev = _simulate(problem, decisions, clock)
        if ev is None:
            break
        if ev.fits and status == cp_model.OPTIMAL:
            return ev.cost_s, decisions, incumbent
        # the relaxation's plan (its optimum, or the best one found when its limit cut
        # it), made to fit: often close to the cheapest plan
        fixed = decisions if ev.fits else greedy.repair(problem, decisions, clock)
        repaired = ev if ev.fits else _simulate(problem, fixed, clock)
        if repaired is not None and repaired.fits and (incumbent is None or repaired.cost_s < incumbent[0]):
            incumbent = (repaired.cost_s, fixed)
        if status != cp_model.OPTIMAL:
            break
        over = sorted(((ev.timeline[k] - problem.budget_bytes, d.step[st.node_id])
                       for k, st in enumerate(ev.steps)
                       if ev.timeline[k] > problem.budget_bytes and st.kind in _NODE_STEPS), reverse=True)
        new = list(dict.fromkeys(t for _, t in over if t not in rows.strengthened))[:ROWS_PER_ROUND]
        if not new:  # the overflow is inside a recomputation run, or deeper than the rows
            break
        for t in new:
            rows.strengthen(t)
    return bound_s, None, incumbent


def _least_peak(problem: Problem, opts: ILPOptions, clock: WorkClock, smallest: dict[int, Decision]):
    """Nothing fits: the plan with the smallest peak under simulate. The min-peak model
    is exact at node steps only, so its peak is a lower bound on simulate's (a peak
    inside a recomputation run can be higher). Loop: ask for a model peak below the best
    simulated peak so far, simulate the answer, keep it if smaller, forbid it; an
    infeasible model proves the best one smallest. `least_peak_stall` solutions in a row
    that lower nothing end it too (no proof then)."""
    best, best_ev = smallest, _simulate(problem, smallest, clock)
    if not cost.charge_build(problem, clock, clock.left_s, at_least_s=MIN_PEAK_SEARCH_S):
        return best  # the limit cannot pay for the model
    model = CanonicalModel(problem, min_peak=True)
    cost.hint(model, smallest, clock)
    stalled = 0
    for _ in range(opts.max_cuts + 1):
        if clock.left_s < MIN_PEAK_SEARCH_S or not cost.affords_call(model, clock, clock.left_s):
            break
        if stalled >= opts.least_peak_stall:
            break
        model.model.add(model.peak <= best_ev.peak_bytes - 1)
        solver = _solver(opts, clock.left_s * cost.det_per_s(model), len(problem.decision_ids))
        if cost.run(solver, model, clock) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break  # INFEASIBLE: no plan peaks lower (or time is up)
        found = model.decisions_of(solver)
        ev = _simulate(problem, found, clock)
        lower = ev is not None and ev.peak_bytes < best_ev.peak_bytes
        if ev is not None and (ev.peak_bytes, ev.cost_s) < (best_ev.peak_bytes, best_ev.cost_s):
            best, best_ev = found, ev
        stalled = 0 if lower else stalled + 1
        model.forbid(found)
    return best


def _solver(opts: ILPOptions, det_s: float, n_values: int = 0, *, search: bool = True) -> cp_model.CpSolver:
    """A CP-SAT solver limited to `det_s` deterministic seconds. search=False: the
    row-generation model, which needs a proof, not plans."""
    solver = cp_model.CpSolver()
    if n_values > LARGE_MODEL_VALUES:
        # Measured at 2,500 values (random_dag, 10k nodes): presolve probing takes ~15 s,
        # so CP-SAT never reaches its search; without it, it improves the warm start.
        solver.parameters.cp_model_probing_level = 0
    # Deterministic time only, never the wall clock: equal inputs give equal plans
    # whatever the machine's load (one worker; several are not repeatable).
    solver.parameters.max_deterministic_time = max(0.002, det_s)
    solver.parameters.num_workers = max(1, opts.workers)
    # Level 2 puts every constraint in the LP (the AND / max definitions of need, rec
    # and liveness included). One worker interleaves CP-SAT's LNS neighbourhoods with
    # that search (deterministic); several run it as the one full-problem worker
    # ("max_lp") beside LNS workers (the default portfolio's LP worker is level 1).
    # GPT-2 small's joint graph (340 values), 10 s, from the greedy plan: at 50%, one
    # worker: bound 6.5e-5 -> 4.6e-4 s, plan 7.3e-4 -> 6.4e-4 s; two workers at 70%:
    # bound 0 -> 1.14e-4 s, plan 1.71e-4 -> 1.50e-4 s. Above LP_LEVEL2_VALUES the
    # bigger LP is too slow to give any bound in 10 s (random_dag, 737 values: bound 0
    # against 0.055 s with the defaults), so those keep the defaults.
    if n_values <= LP_LEVEL2_VALUES:
        solver.parameters.linearization_level = 2
        # The rows alone, one worker: without LNS interleaved, GPT-2 at 50% proves
        # its first optimum in 0.24 s instead of 4.7 s.
        if opts.workers <= 1 and search:
            solver.parameters.interleave_search = True
        else:
            solver.parameters.subsolvers.append("max_lp")
    solver.parameters.random_seed = opts.seed
    return solver


def _lower_bound(solver: cp_model.CpSolver, model: CanonicalModel) -> float:
    """CP-SAT's objective bound in seconds, less the largest possible rounding."""
    slack = 0.5 * len(model.data.decision) * (2 if model.off else 1)
    return max(0.0, (solver.best_objective_bound - slack) / model.scale)


def _simulate(problem: Problem, decisions: dict[int, Decision], clock: WorkClock | None = None):
    try:
        ev = evaluate(problem, decisions)
    except PlanError:  # cannot happen for a model solution; treat as not fitting
        log.warning("ilp: model solution rejected by simulate as invalid")
        return None
    if clock is not None:
        clock.charge_steps(len(ev.steps))
    return ev


def warm_start(problem: Problem, opts: ILPOptions, clock: WorkClock, until_s: float):
    """(cost, decisions) of the cheapest fitting plan among the hint, the warm-start
    solvers (run until `clock` has spent `until_s`) and the two trivial plans, or None;
    the decisions of the smallest peak seen; and whether an exact warm-start solver (dp)
    proved its plan OPTIMAL (then it is returned)."""
    candidates = [decisions_all(problem, Decision.SAVE), decisions_all(problem, Decision.RECOMPUTE)]
    if opts.hint is not None:
        candidates.insert(0, hint_decisions(opts.hint))
    proven = None
    for name in opts.warm_start:
        remaining = until_s - clock.spent_s
        if name not in SOLVERS or remaining <= 0:
            continue
        try:
            plan = SOLVERS[name].run(problem, make_options(name, time_limit_s=remaining, seed=opts.seed))
        except UnsupportedProblem as declined:
            clock.charge_s(declined.work_s)
            continue
        except TypeError:
            continue
        clock.charge_s(plan.work_s)
        candidates.append(dict(plan.decisions))
        if SOLVERS[name].exact and plan.status is Status.OPTIMAL and plan.schedule is None:
            proven = (plan.objective_s, dict(plan.decisions))
            break
    best, smallest = None, None
    for decisions in candidates:
        ev = _simulate(problem, decisions, clock)
        if ev is None:
            continue
        if smallest is None or (ev.peak_bytes, ev.cost_s) < smallest[0]:
            smallest = ((ev.peak_bytes, ev.cost_s), decisions)
        if ev.fits and (best is None or ev.cost_s < best[0]):
            best = (ev.cost_s, decisions)
    if proven is not None and (best is None or proven[0] <= best[0]):
        return proven, smallest[1], True
    return best, smallest[1], False
