"""Solver benchmark: solve seconds, objective, lower bound, gap, ratio to chen-greedy.

Problems: seeded random layered DAGs (builders.random_dag) and transformer-like stacks
(builders.transformer, vocab 2048 so that activations, not the logits, dominate) of
about 100, 300, 1,000, 3,000 and 10,000 nodes, plus, with --zoo and when the torch front
end can build problems, the joint graphs of the public test models (remat.zoo); each at
30%, 50% and 70% of its no-remat peak. Solvers: chen-greedy (the baseline), dp, ilp.

    python bench/solvers.py                      # everything (about 10 minutes)
    python bench/solvers.py --sizes 100 1000 --families transformer --budgets 0.5
    python bench/solvers.py --zoo --families --json results.json

Columns: status (opt = OPTIMAL, feas = FEASIBLE, inf = INFEASIBLE, n/a = the solver
refused the structure), seconds, objective (extra seconds of the step), lower bound,
gap = (objective - bound) / objective, and objective / chen-greedy's objective.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers import Problem, Status, UnsupportedProblem, solve  # noqa: E402
from solvers import builders  # noqa: E402

SIZES = (100, 300, 1000, 3000, 10_000)
BUDGETS = (0.3, 0.5, 0.7)
SOLVERS = ("chen-greedy", "dp", "ilp")
NODES_PER_DAG_OP = 4.07  # random_dag: one forward op gives about 4 joint nodes
NODES_PER_LAYER = 59  # transformer: nodes per layer (forward + backward)


def random_dag(nodes: int) -> Problem:
    return builders.random_dag(max(2, round(nodes / NODES_PER_DAG_OP)), seed=0, view_prob=0.1,
                               nonrecomputable_prob=0.02)


def transformer(nodes: int) -> Problem:
    return builders.transformer(max(2, round((nodes - 12) / NODES_PER_LAYER)), vocab=2048)


FAMILIES = {"dag": random_dag, "transformer": transformer}


def zoo_problems() -> dict[str, Problem]:
    """The joint graphs of the public test models, or {} without the torch front end."""
    try:
        import remat
        from remat import zoo
    except ImportError as error:
        print(f"# zoo skipped: {error}", file=sys.stderr)
        return {}
    out = {}
    for name in zoo.NAMES:
        size = "small" if name == "gpt2" else "bench"
        try:
            case = zoo.build(name, size=size)
            planned = remat.plan(case.model, case.args, case.kwargs, budget="100%", solver="none")
            out[f"{name}-{size}"] = planned.problem
        except Exception as error:  # a model the front end cannot trace yet: report, go on
            print(f"# zoo {name}: {type(error).__name__}: {error}", file=sys.stderr)
    return out


def run(problem: Problem, solver: str, time_limit_s: float, workers: int) -> dict:
    options = {"time_limit_s": time_limit_s, "workers": workers} if solver == "ilp" else {}
    started = time.perf_counter()
    try:
        plan = solve(problem, solver, **options)
    except UnsupportedProblem as error:
        return {"solver": solver, "status": "n/a", "seconds": time.perf_counter() - started, "why": str(error)}
    bound = plan.lower_bound_s
    gap = None
    if bound is not None and plan.status is not Status.INFEASIBLE:
        gap = 0.0 if plan.objective_s <= 0 else max(0.0, (plan.objective_s - bound) / plan.objective_s)
    return {
        "solver": solver,
        "status": {Status.OPTIMAL: "opt", Status.FEASIBLE: "feas", Status.INFEASIBLE: "inf"}[plan.status],
        "seconds": time.perf_counter() - started,
        "objective_s": plan.objective_s,
        "lower_bound_s": bound,
        "gap": gap,
        "peak_bytes": plan.peak_bytes,
    }


def bench(problems: dict[str, Problem], budgets, solvers, time_limit_s: float, workers: int) -> list[dict]:
    rows = []
    for name, base in problems.items():
        for fraction in budgets:
            problem = builders.with_budget_fraction(base, fraction)
            results = [run(problem, s, time_limit_s, workers) for s in solvers]
            baseline = next((r for r in results if r["solver"] == "chen-greedy"), None)
            for r in results:
                r.update(problem=name, nodes=len(problem.nodes), budget=fraction)
                if baseline and baseline.get("objective_s") and r.get("objective_s") is not None \
                        and baseline["status"] != "inf" and r["status"] != "inf":
                    r["ratio"] = r["objective_s"] / baseline["objective_s"]
                rows.append(r)
                print(_line(r), flush=True)
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADER = ("| problem | nodes | budget | solver | status | seconds | objective (s) | lower bound (s) "
          "| gap | vs chen-greedy |\n|---|---:|---:|---|---|---:|---:|---:|---:|---:|")


def _line(r: dict) -> str:
    return (f"| {r['problem']} | {r['nodes']} | {r['budget']:.0%} | {r['solver']} | {r['status']} | "
            f"{r['seconds']:.2f} | {_fmt(r.get('objective_s'), '.4g')} | {_fmt(r.get('lower_bound_s'), '.4g')} | "
            f"{_fmt(r.get('gap'), '.1%')} | {_fmt(r.get('ratio'), '.3f')} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="approximate node counts")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    parser.add_argument("--solvers", nargs="*", default=list(SOLVERS))
    parser.add_argument("--time-limit", type=float, default=10.0, help="ilp's time limit (s)")
    parser.add_argument("--workers", type=int, default=2, help="ilp's CP-SAT workers")
    parser.add_argument("--zoo", action="store_true", help="also the public test models' joint graphs")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    problems = {f"{family}-{size}": FAMILIES[family](size) for family in args.families for size in args.sizes}
    if args.zoo:
        problems.update(zoo_problems())
    print(HEADER, flush=True)
    rows = bench(problems, args.budgets, args.solvers, args.time_limit, args.workers)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
