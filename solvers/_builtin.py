"""Registration of the built-in solvers, in one place."""

from solvers.base import Options
from solvers.registry import SolverSpec, register
from solvers.trivial import solve_all, solve_none

register(SolverSpec(name="none", run=solve_none, options_type=Options, exact=False,
                    summary="save every activation (no rematerialization)"))
register(SolverSpec(name="all", run=solve_all, options_type=Options, exact=False,
                    summary="recompute every recomputable activation"))

# --- heuristics and oracle (chen-sqrt, chen-greedy, brute) ---

# --- exact solvers and auto (dp, ilp, auto) ---
