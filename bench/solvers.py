"""Solver benchmark: solve seconds, objective, lower bound, gap, ratio to chen-greedy.

Problems: seeded random layered DAGs (builders.random_dag) and transformer-like stacks
(builders.transformer, vocab 2048 so that activations, not the logits, dominate) of
about 100, 300, 1,000, 3,000 and 10,000 nodes, plus, with --zoo and when the torch front
end can build problems, the joint graphs of the public test models (remat.testing.zoo); each at
30%, 50% and 70% of its no-remat peak. Solvers: chen-greedy (the baseline), dp, ilp.

    python bench/solvers.py                      # everything (about 10 minutes)
    python bench/solvers.py --sizes 100 1000 --families transformer --budgets 0.5
    python bench/solvers.py --zoo --families --json results.json
    python bench/solvers.py --backends           # why CP-SAT: the MIP under SCIP / CBC
    python bench/solvers.py --depth              # deep narrow GPT-2 / LLaMA, trace to rewrite

Columns: status (opt = OPTIMAL, feas = FEASIBLE, inf = INFEASIBLE, n/a = the solver
refused the structure), seconds, objective (extra seconds of the step), lower bound,
gap = (objective - bound) / objective, objective / chen-greedy's objective, and the
plan's simulated peak / the budget (above 1 only for INFEASIBLE: the smallest peak found).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from remat_solvers import Problem, Status, UnsupportedProblem, builders, solve

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
        from remat.testing import zoo
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
        "peak_ratio": plan.peak_bytes / problem.budget_bytes if problem.budget_bytes else None,
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
          "| gap | vs chen-greedy | peak / budget |\n|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")


def _line(r: dict) -> str:
    return (f"| {r['problem']} | {r['nodes']} | {r['budget']:.0%} | {r['solver']} | {r['status']} | "
            f"{r['seconds']:.2f} | {_fmt(r.get('objective_s'), '.4g')} | {_fmt(r.get('lower_bound_s'), '.4g')} | "
            f"{_fmt(r.get('gap'), '.1%')} | {_fmt(r.get('ratio'), '.3f')} | {_fmt(r.get('peak_ratio'), '.3f')} |")


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
    parser.add_argument("--depth", action="store_true",
                        help="only the depth table: deep narrow GPT-2 / LLaMA planned end to end (bench/depth.py)")
    parser.add_argument("--backends", action="store_true",
                        help="only compare CP-SAT with a time-indexed MIP under SCIP and CBC")
    args = parser.parse_args(argv)
    if args.depth:
        import depth  # bench/depth.py, next to this file

        rows = depth.main([])
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    if args.backends:
        compare_backends(args.time_limit)
        return
    problems = {f"{family}-{size}": FAMILIES[family](size) for family in args.families for size in args.sizes}
    if args.zoo:
        problems.update(zoo_problems())
    print(HEADER, flush=True)
    rows = bench(problems, args.budgets, args.solvers, args.time_limit, args.workers)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))



# ---- why CP-SAT: the same node-step model as a time-indexed MIP (SCIP / CBC) ----


def mip_model(problem: Problem, backend: str):
    """solvers/ilp/model.py's node-step model as a time-indexed MIP, for problems without
    views or offload: y[v,t] = "v brought back by node t", q[v,t] = "v read at or after t",
    a[v,t] = "v's storage live at t"; memory <= budget at every node step."""
    from ortools.linear_solver import pywraplp
    from remat_solvers.ilp.data import model_data

    d, nodes = model_data(problem), problem.nodes
    if any(nodes[v].alias_of is not None for v in d.decision) or problem.offload_bandwidth_bytes_per_s:
        raise ValueError("the MIP comparison covers problems without views or offload")
    mip = pywraplp.Solver.CreateSolver(backend)
    F = len(problem.forward_ids)
    back = range(F, d.n_steps)
    save, rec, need, y, q = {}, {}, {}, {}, {}
    for v in reversed(d.decision):
        save[v], rec[v], need[v] = (mip.BoolVar(f"{k}_{v}") for k in ("save", "rec", "need"))
        drop = 1 - save[v]
        mip.Add(rec[v] <= drop)
        mip.Add(rec[v] <= need[v])
        mip.Add(rec[v] >= drop + need[v] - 1)
        if not nodes[v].recomputable:
            mip.Add(rec[v] == 0)
        mip.Add(save[v] >= 1 - need[v])
        kids = d.children[v]
        if v in d.first_read:
            mip.Add(need[v] == 1)
        else:
            for c in kids:
                mip.Add(need[v] >= rec[c])
            mip.Add(need[v] <= sum(rec[c] for c in kids))
        for t in back:
            direct = int(v in d.first_read and d.first_read[v] <= t)
            y[v, t] = mip.BoolVar(f"y_{v}_{t}")
            ws = []
            for c in kids:
                mip.Add(y[v, t] >= rec[c] + y[c, t] - 1)
                w = mip.BoolVar(f"w_{v}_{c}_{t}")
                mip.Add(w <= rec[c])
                mip.Add(w <= y[c, t])
                ws.append(w)
            mip.Add(y[v, t] >= direct)
            mip.Add(y[v, t] <= direct + sum(ws))
        for t in range(d.n_steps):
            q[v, t] = mip.BoolVar(f"q_{v}_{t}")
            mip.Add(q[v, t] >= int(v in d.last_read and t <= d.last_read[v]))
            for c in kids:
                mip.Add(q[v, t] >= rec[c] - (y[c, t] if t >= F else 0))
    for t in range(d.n_steps):
        live = []
        for v in d.decision:
            if d.step[v] > t or not nodes[v].out_bytes:
                continue
            if t <= d.forward_end[v]:
                live.append(nodes[v].out_bytes)
                continue
            a = mip.BoolVar(f"a_{v}_{t}")
            mip.Add(a >= save[v] + q[v, t] - 1)
            if t >= F:
                mip.Add(a >= rec[v] + y[v, t] + q[v, t] - 2)
            live.append(nodes[v].out_bytes * a)
        mip.Add(sum(live) <= problem.budget_bytes - d.static[t])
    mip.Minimize(sum(nodes[v].compute_s * rec[v] for v in d.decision))
    return mip


def compare_backends(time_limit_s: float) -> None:
    """CP-SAT (ilp, no warm start) against the MIP under SCIP and CBC on view-free problems."""
    cases = {f"dag{n}": builders.random_dag(n, seed=n) for n in (10, 20, 40, 80)}
    cases.update({f"chain{n}": builders.chain(n) for n in (20, 60)})
    print("| problem | decision values | budget | backend | status | seconds | objective (s) |\n"
          "|---|---:|---:|---|---|---:|---:|")
    for name, base in cases.items():
        for fraction in (0.5, 0.7):
            problem = builders.with_budget_fraction(base, fraction)
            head = f"| {name} | {len(problem.decision_ids)} | {fraction:.0%}"
            started = time.perf_counter()
            plan = solve(problem, "ilp", warm_start=(), time_limit_s=time_limit_s)
            print(f"{head} | CP-SAT | {plan.status.value} | {time.perf_counter() - started:.2f} | "
                  f"{plan.objective_s:.4g} |", flush=True)
            for backend in ("SCIP", "CBC"):
                started = time.perf_counter()
                mip = mip_model(problem, backend)
                mip.SetTimeLimit(int(time_limit_s * 1000))
                status = mip.Solve()
                seconds = time.perf_counter() - started
                label = {0: "optimal", 1: "feasible", 2: "infeasible"}.get(status, "no solution")
                value = mip.Objective().Value() if status in (0, 1) else float("nan")
                print(f"{head} | {backend} | {label} | {seconds:.2f} | {value:.4g} |", flush=True)


if __name__ == "__main__":
    main()
