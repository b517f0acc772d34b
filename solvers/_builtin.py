"""Registration of the built-in solvers, in one place."""

from remat_solvers.base import Options
from remat_solvers.registry import SolverSpec, register
from remat_solvers.trivial import solve_all, solve_none

register(SolverSpec(name="none", run=solve_none, options_type=Options, exact=False,
                    summary="save every activation (no rematerialization)"))
register(SolverSpec(name="all", run=solve_all, options_type=Options, exact=False,
                    summary="recompute every recomputable activation"))

# --- heuristics and oracle (chen-sqrt, chen-greedy, brute) ---
from remat_solvers.brute import solve_brute  # noqa: E402
from remat_solvers.chen import solve_chen_greedy, solve_chen_sqrt  # noqa: E402

register(SolverSpec(name="chen-sqrt", run=solve_chen_sqrt, options_type=Options, exact=False,
                    summary="Chen 2016: save ~sqrt(N) evenly spaced cut points"))
register(SolverSpec(name="chen-greedy", run=solve_chen_greedy, options_type=Options, exact=False,
                    summary="Chen 2016 Algorithm 3 with a search over the memory threshold"))
register(SolverSpec(name="brute", run=solve_brute, options_type=Options, exact=True,
                    summary="exhaustive oracle for small problems (<= 18 decision values)"))

from remat_solvers.greedy import solve_greedy  # noqa: E402

register(SolverSpec(name="greedy", run=solve_greedy, options_type=Options, exact=False,
                    summary="recompute the cheapest bytes first (out_bytes / compute_s), then trim"))

# --- exact solvers and auto (dp, ilp, auto) ---
from remat_solvers.dp.solver import DPOptions, solve_dp  # noqa: E402

register(SolverSpec(name="dp", run=solve_dp, options_type=DPOptions, exact=True,
                    summary="exact DP over chains and block sequences (articulation points)"))
from remat_solvers.ilp.solver import ILPOptions, solve_ilp  # noqa: E402

register(SolverSpec(name="ilp", run=solve_ilp, options_type=ILPOptions, exact=True,
                    summary="CP-SAT over the canonical plan space, checked by simulate (no-good cuts)"))
from remat_solvers.layers import LayersOptions, solve_layers  # noqa: E402

register(SolverSpec(name="layers", run=solve_layers, options_type=LayersOptions, exact=False,
                    summary="exact DP over repeated layers (Problem.layers), values shared "
                            "between layers kept; optimal over that space"))
from remat_solvers.segmented import solve_checkpoint  # noqa: E402

register(SolverSpec(name="checkpoint", run=solve_checkpoint, options_type=Options, exact=False,
                    summary="per-layer checkpointing (Problem.layers): layer inputs saved, each layer "
                            "replayed just before its backward and freed after"))
from remat_solvers.auto import AutoOptions, solve_auto  # noqa: E402

register(SolverSpec(name="auto", run=solve_auto, options_type=AutoOptions, exact=True,
                    summary="brute if tiny, dp if a block sequence, else ilp (see solvers/auto.py)"))
