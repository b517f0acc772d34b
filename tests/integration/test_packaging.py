"""What `pip install` puts on a user's path: `remat` and the torch-free solver core as
`remat_solvers` (from the repository folder solvers/), never a top-level `solvers` that
could collide with another project's."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _package_folders() -> set[str]:
    names = set()
    for folder, installed in (("remat", "remat"), ("solvers", "remat_solvers")):
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((installed, *parts)))
    return names


def test_pyproject_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"remat_solvers": "solvers"}
    assert set(config["packages"]) == _package_folders()


def test_the_installed_names_outside_the_checkout(tmp_path):
    """From a folder outside the checkout, `remat` and `remat_solvers` import from the
    install, every remat module but `__main__` imports without reaching for a top-level `solvers`, and
    no such package exists."""
    child = (
        "import importlib, importlib.util, pkgutil, sys\n"
        "import remat, remat_solvers\n"
        "for info in pkgutil.walk_packages(remat.__path__, 'remat.'):\n"
        "    if not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "assert importlib.util.find_spec('solvers') is None, importlib.util.find_spec('solvers')\n"
        "assert 'solvers' not in sys.modules\n"
        "print(remat_solvers.__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert pathlib.Path(result.stdout.strip()).parent.name == "solvers"


# remat's rooms in the order the pipeline runs them; a module imports only from its own
# room or an earlier one at module level (a function-local import upward names its reason)
LAYERS = (
    ("errors", "compat", "budget"),  # the vocabulary every room uses
    ("frontend",),  # trace, profile, cost, build the Problem
    ("offload",),  # what offload costs, and its host copies
    ("planning",),  # settings, floor, passes over a plan
    ("runtime",),  # rewrite and run a plan
    ("partitioner",),  # front end + planning + rewrite for one joint graph
    ("report",),  # read a planned step
    ("api", "compile_backend"),  # the entry points: remat.plan, remat.backend
    ("cli", "testing", "__init__", "__main__"),
)


def _layer(module: str) -> int:
    room = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def test_module_level_imports_run_down_the_pipeline():
    upward = []
    for path in sorted((ROOT / "remat").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom) or (node.module or "").split(".")[0] != "remat":
                continue
            targets = ([f"remat.{alias.name}" for alias in node.names] if node.module == "remat"
                       else [node.module])
            upward += [f"{path.relative_to(ROOT)}:{node.lineno} imports {target}" for target in targets
                       if _layer(target) > _layer(module)]
    assert upward == []
