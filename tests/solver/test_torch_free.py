"""`solvers` must never import torch or remat: import it, and run every registered solver,
in a fresh interpreter where both are unimportable."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import importlib.abc, sys

    class Forbid(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "remat"):
                raise ImportError(f"solvers imported {name}")
            return None

    sys.meta_path.insert(0, Forbid())
    try:
        import torch  # the guard itself must work
    except ImportError:
        pass
    else:
        raise SystemExit("the import guard failed")

    import remat_solvers
    from remat_solvers import SOLVERS, UnsupportedProblem, solve
    from remat_solvers.builders import chain, random_dag, with_budget_fraction

    problems = [with_budget_fraction(chain(4), 0.6), with_budget_fraction(random_dag(6, seed=1), 0.8)]
    for name in sorted(SOLVERS):
        for problem in problems:
            try:
                solve(problem, name)
            except UnsupportedProblem:
                pass
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "remat"))
    if loaded:
        raise SystemExit(f"loaded: {loaded}")
    print("ok", len(SOLVERS))
    """
)


def test_solvers_never_import_torch_or_remat():
    result = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")
