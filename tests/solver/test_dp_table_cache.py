"""dp's block tables on disk (solvers/dp/table_cache.py): a later process reads what an
earlier one built and plans exactly as if it had built it; a bad file or a cache turned
off means building, never a failed solve."""

from __future__ import annotations

import pickle

import pytest

import remat_solvers.dp.tables as dp
from remat_solvers import UnsupportedProblem, builders, solve
from remat_solvers.dp import table_cache
from test_layered import stack


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The cache on, under tmp_path, writing every table; the process cache empty."""
    monkeypatch.setenv(table_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(table_cache.ENABLE_ENV, "1")
    monkeypatch.setattr(table_cache, "MIN_CONFIGS", 1)
    dp._TABLES.clear()
    yield tmp_path / table_cache.SUBDIR
    dp._TABLES.clear()


def _problem_for(solver: str = "dp"):
    """What `solver` plans from dp's block tables here: a layered stack, or a transformer chain."""
    if solver == "layers":  # a stack that carries its layer structure
        return builders.with_budget_fraction(stack(4, seed=1), 0.7)
    return builders.with_budget_fraction(builders.transformer(3, seq=64, d_model=64, n_heads=2, vocab=64), 0.6)


def _count_builds(monkeypatch) -> list[int]:
    """Replace dp._table by a wrapper that records the configurations of each table built
    (one pass builds the tables of every block of one canonical form)."""
    built, table = [], dp._table

    def counted(*args, **kwargs):
        out = table(*args, **kwargs)
        built.extend(out[1] for _ in out[0])
        return out

    monkeypatch.setattr(dp, "_table", counted)
    return built


def _refuse_builds(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a table was built although it is on disk")

    monkeypatch.setattr(dp, "_table", refuse)


def _same_plan(a, b) -> None:
    assert a.decisions == b.decisions and a.status is b.status
    assert a.objective_s == b.objective_s and a.peak_bytes == b.peak_bytes
    assert a.work_s == b.work_s > 0  # the clock charged exactly as building did


@pytest.mark.parametrize("solver", ["dp", "layers"])
def test_tables_written_by_one_solve_are_read_by_the_next_with_the_same_plan_and_clock(cache, monkeypatch,
                                                                                       solver):
    problem = _problem_for(solver)
    built = _count_builds(monkeypatch)
    first = solve(problem, solver)
    files = sorted(cache.glob("*.pkl"))
    assert len(files) == len(built) == len(dp._TABLES) >= 2  # one file per distinct table
    assert not list(cache.glob("*.tmp"))
    dp._TABLES.clear()  # as in a fresh process
    _refuse_builds(monkeypatch)
    _same_plan(first, solve(problem, solver))
    # a limit cuts a disk hit where it cuts building: the clock is charged the same way
    dp._TABLES.clear()
    with pytest.raises(UnsupportedProblem, match="time limit"):
        solve(problem, solver, time_limit_s=first.work_s / 2)


@pytest.mark.parametrize("bad", [b"", b"not a pickle", "truncated", pickle.dumps(("a", 1))])
def test_a_corrupt_file_is_rebuilt_and_rewritten(cache, monkeypatch, bad):
    problem = _problem_for()
    first = solve(problem, "dp")
    files = sorted(cache.glob("*.pkl"))
    good = {f: f.read_bytes() for f in files}
    for f in files:
        f.write_bytes(good[f][: len(good[f]) // 2] if bad == "truncated" else bad)
    dp._TABLES.clear()
    built = _count_builds(monkeypatch)
    _same_plan(first, solve(problem, "dp"))
    assert len(built) == len(files)
    assert {f: f.read_bytes() for f in files} == good  # rewritten, whole


def test_cache_off_neither_writes_nor_reads(cache, monkeypatch):
    problem = _problem_for()
    monkeypatch.setenv(table_cache.ENABLE_ENV, "0")
    built = _count_builds(monkeypatch)
    first = solve(problem, "dp")
    assert built and not cache.exists()
    # tables on disk are ignored while it is off
    monkeypatch.setenv(table_cache.ENABLE_ENV, "1")
    dp._TABLES.clear()
    built.clear()
    solve(problem, "dp")
    assert len(list(cache.glob("*.pkl"))) == len(built)
    monkeypatch.setenv(table_cache.ENABLE_ENV, "0")
    dp._TABLES.clear()
    built.clear()
    _same_plan(first, solve(problem, "dp"))
    assert built


def test_small_tables_are_not_written(cache, monkeypatch):
    monkeypatch.setattr(table_cache, "MIN_CONFIGS", 4096)
    built = _count_builds(monkeypatch)
    solve(_problem_for(), "dp")
    assert built and max(built) < 4096 and not cache.exists()


def test_an_unwritable_cache_dir_does_not_fail_the_solve(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(table_cache.CACHE_ENV, str(blocker))  # dp-tables cannot be made under a file
    plan = solve(_problem_for(), "dp")
    assert plan.work_s > 0 and blocker.is_file()


def test_the_file_name_depends_on_the_code_signature_and_limit(cache, monkeypatch):
    sig = (("block",), None)
    name = table_cache.path_for(sig, 1 << 14)
    assert name.parent == cache
    assert table_cache.path_for(sig, 1 << 14) == name
    assert table_cache.path_for(sig, 1 << 17) != name
    assert table_cache.path_for((("other",), None), 1 << 14) != name
    monkeypatch.setattr(table_cache, "source_hash", lambda: "edited")
    assert table_cache.path_for(sig, 1 << 14) != name
