"""dp: its block decomposition reproduces simulate exactly, it equals brute on chains and
block sequences, it refuses what it cannot do with a clear message, and it is fast on a
10,000-node transformer stack."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat_solvers import Decision, Node, Phase, PlanError, Problem, Status, UnsupportedProblem, simulate, solve
from remat_solvers import builders
from remat_solvers.dp.solver import predict
from remat_solvers.dp.tables import block_tables
from remat_solvers.dp.local import InvalidLocal
from remat_solvers.dp.structure import analyze
from oracles import REL, assert_equals_brute
from strategies import COSTS, problems





# ---- the decomposition is simulate ----


def assert_predicts(problem: Problem, decisions: dict[int, Decision]) -> None:
    """predict (dp's block-by-block accounting) == simulate, PlanError included."""
    try:
        ev = simulate(problem, decisions)
    except PlanError:
        with pytest.raises(InvalidLocal):
            predict(problem, decisions)
        return
    cost, peak = predict(problem, decisions)
    assert peak == ev.peak_bytes
    assert cost == pytest.approx(ev.cost_s, **REL)


@settings(max_examples=80)
@given(problem=problems(max_forward=7), data=st.data())
def test_decomposition_equals_simulate_on_random_plans(problem, data):
    analyze(problem)  # every strategies problem is a block sequence (possibly one block)
    for _ in range(8):
        save_share = data.draw(st.sampled_from([0.1, 0.5, 0.9]))
        decisions = {i: Decision.SAVE if data.draw(st.floats(0, 1)) < save_share
                     else data.draw(st.sampled_from(problem.allowed(i)))
                     for i in problem.decision_ids}
        assert_predicts(problem, decisions)


@pytest.mark.parametrize("make", [
    lambda: builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True,
                                 offload_bandwidth_bytes_per_s=1e9),
    lambda: builders.unet(2, batch=1, channels=4, resolution=16),
    lambda: builders.random_dag(14, seed=2, skip_prob=0.2, view_prob=0.3, nonrecomputable_prob=0.2,
                                offload_bandwidth_bytes_per_s=1e9),
], ids=["transformer2", "unet2", "dag14"])
@settings(max_examples=30)
@given(data=st.data())
def test_decomposition_equals_simulate_on_built_problems(make, data):
    problem = make()
    assert len(analyze(problem).blocks) > 2
    ids = problem.decision_ids
    decisions = dict(zip(ids, data.draw(st.tuples(*(st.sampled_from(problem.allowed(i)) for i in ids)))))
    assert_predicts(problem, decisions)


# ---- dp equals brute ----


@settings(max_examples=150)
@given(problem=problems(max_forward=7))
def test_dp_equals_brute_on_small_problems(problem):
    assert_equals_brute(problem, solve(problem, "dp"))


@st.composite
def hetero_chains(draw) -> Problem:
    n = draw(st.integers(2, 10))
    problem = builders.heterogeneous_chain(
        draw(st.lists(st.integers(1, 64), min_size=n, max_size=n)),
        draw(st.lists(st.sampled_from(COSTS), min_size=n, max_size=n)),
        param_bytes=draw(st.integers(0, 8)),
    )
    return builders.with_budget_fraction(problem, draw(st.floats(0.2, 1.0)))


@settings(max_examples=40)
@given(problem=hetero_chains())
def test_dp_equals_brute_on_heterogeneous_chains(problem):
    assert len(analyze(problem).blocks) == len(problem.decision_ids)  # one value per block
    assert_equals_brute(problem, solve(problem, "dp"))


_SEQUENCES = {
    "chain16": lambda: builders.chain(16),
    "dag16": lambda: builders.random_dag(16, seed=2, skip_prob=0.2, view_prob=0.2, nonrecomputable_prob=0.1),
    "chain12": lambda: builders.chain(12),
    "dag12": lambda: builders.random_dag(12, seed=7, skip_prob=0.3, view_prob=0.3, nonrecomputable_prob=0.2),
    "dag8-offload": lambda: builders.random_dag(8, seed=4, view_prob=0.3, offload_bandwidth_bytes_per_s=4e8),
    "unet1": lambda: builders.unet(1, batch=1, channels=4, resolution=16),
}


@pytest.mark.parametrize(("name", "fraction"), [
    ("chain16", 0.4), ("dag16", 0.6),  # 2**16 simulations each for brute: one budget
    *((name, f) for name in ("chain12", "dag12", "dag8-offload", "unet1") for f in (0.3, 0.5, 0.7, 0.9)),
])
def test_dp_equals_brute_on_block_sequences_up_to_16_values(name, fraction):
    problem = builders.with_budget_fraction(_SEQUENCES[name](), fraction)
    assert len(problem.decision_ids) <= 16
    assert len(analyze(problem).blocks) > 1
    assert_equals_brute(problem, solve(problem, "dp"))


# ---- metamorphic ----


@settings(max_examples=60)
@given(problem=problems(max_forward=6), extra=st.integers(1, 300))
def test_more_budget_never_makes_dp_worse(problem, extra):
    tight, loose = solve(problem, "dp"), solve(problem.with_budget(problem.budget_bytes + extra), "dp")
    if tight.status is Status.OPTIMAL:
        assert loose.status is Status.OPTIMAL and loose.objective_s <= tight.objective_s
    else:
        assert loose.peak_bytes >= tight.peak_bytes


# ---- structure: what dp accepts and refuses ----


def test_transformer_layers_share_their_tables():
    problem = builders.transformer(8, batch=1, seq=16, d_model=32, n_heads=2, vocab=64)
    seq = analyze(problem)
    tables = block_tables(problem, seq, 1 << 14)
    assert len(seq.blocks) > 16
    # first layer, middle layers, last layer: far fewer tables than blocks
    assert len({id(table) for table, _ in tables}) <= 8


def _backward_view_problem() -> Problem:
    """x -> a -> loss; backward reads t(a), a view of the activation a."""
    F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT
    nodes = (
        Node(name="x", inputs=(), out_bytes=8, phase=I),
        Node(name="a", inputs=(0,), out_bytes=8, phase=F, compute_s=1.0),
        Node(name="loss", inputs=(1,), out_bytes=4, phase=F),
        Node(name="tangent", inputs=(), out_bytes=4, phase=B),
        Node(name="a_t", inputs=(1,), out_bytes=8, phase=B, alias_of=1),
        Node(name="grad_x", inputs=(3, 4), out_bytes=8, phase=B),
    )
    return Problem(nodes=nodes, outputs=(2, 5), budget_bytes=100)


def test_dp_refuses_backward_views_of_activations_and_names_ilp():
    with pytest.raises(UnsupportedProblem, match=r"^dp: .*view of forward value 1.*'ilp'"):
        solve(_backward_view_problem(), "dp")


def test_dp_refuses_a_block_too_large_to_enumerate():
    problem = builders.random_dag(12, seed=0, skip_prob=1.0, max_skip=12)  # skips everywhere
    assert max(len(b.values) for b in analyze(problem).blocks) >= 8
    with pytest.raises(UnsupportedProblem, match="max_block_configs=16"):
        solve(problem, "dp", max_block_configs=16)


def test_a_non_recomputable_boundary_is_never_dropped():
    problem = builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True)
    plan = solve(builders.with_budget_fraction(problem, 0.9), "dp")
    simulate(problem, plan)  # no PlanError
    for i, d in plan.decisions.items():
        if not problem.nodes[i].recomputable and i in problem.needed_ids:
            assert d is Decision.SAVE


# ---- large: a 10,000-node transformer stack ----


def test_dp_is_optimal_on_a_10k_node_transformer_in_seconds():
    problem = builders.with_budget_fraction(builders.transformer(169), 0.5)
    assert len(problem.nodes) > 9_900
    plan = solve(problem, "dp")  # ~1.5 s unloaded on 2 cores: see bench/solvers.py
    assert plan.status is Status.OPTIMAL and plan.lower_bound_s == plan.objective_s
    greedy = solve(problem, "chen-greedy")
    assert plan.objective_s <= 0.8 * greedy.objective_s  # at least 20% less recompute


def test_dp_options_are_documented_and_frozen():
    from remat_solvers.dp.solver import DPOptions

    opts = DPOptions(max_block_configs=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_block_configs = 9  # type: ignore[misc]
    assert opts.time_limit_s is None and opts.workers == 1


# ---- exact pruning of configurations ----


def _fires(problem: Problem) -> bool:
    from remat_solvers.dp.configs import _save_dominated

    readers = set(problem.needed_ids)
    return any(_save_dominated(problem, b, readers) for b in analyze(problem).blocks)


@st.composite
def feeder_chains(draw) -> Problem:
    """A residual block around a chain in which many values feed one reader only and
    backward reads few of them (the shape the SAVE dominance prunes), with random bytes,
    costs and skips."""
    from remat_solvers.builders import FwdOp, joint_from_forward
    from strategies import peaks

    ops = [FwdOp(name="x", out_bytes=draw(st.integers(0, 64)), phase=Phase.INPUT, requires_grad=True)]
    for k in range(draw(st.integers(3, 7))):
        v = len(ops)
        shape = draw(st.integers(0, 5))  # a chain link, a diamond (reads the two last), a skip
        inputs = ((v - 1,) if shape < 3 or v < 3 else (v - 1, v - 2) if shape < 5
                  else tuple(dict.fromkeys((v - 1, draw(st.integers(0, v - 1))))))
        ops.append(FwdOp(name=f"v{k}", out_bytes=draw(st.sampled_from([8, 16, 32, 64, 96])), inputs=inputs,
                         compute_s=draw(st.sampled_from(COSTS)),
                         grad_reads=draw(st.sampled_from([(), (), (v,), inputs[:1]])),
                         recomputable=draw(st.integers(0, 6)) > 0))
    # a residual add closes one block around the chain
    ops.append(FwdOp(name="add", out_bytes=64, inputs=(len(ops) - 1, 1), compute_s=0.125))
    ops.append(FwdOp(name="loss", out_bytes=4, inputs=(len(ops) - 1,), compute_s=0.5,
                     grad_reads=(len(ops) - 1,)))
    problem = joint_from_forward(ops)
    lo, hi = sorted(peaks(problem))
    return problem.with_budget(draw(st.one_of(st.integers(lo, hi), st.integers(lo * 4 // 5, lo))))


@settings(max_examples=80)
@given(problem=feeder_chains())
def test_save_dominance_keeps_dp_equal_to_brute(problem):
    """Problems where a SAVE is pruned (a value read only by a no-larger reader that
    recomputes from it alone): dp, which never enumerates those plans, still equals brute
    (cheapest plan, or the least peak when nothing fits)."""
    from hypothesis import assume

    assume(_fires(problem))
    assert_equals_brute(problem, solve(problem, "dp"))


def test_save_dominance_cuts_the_configurations_of_a_transformer_block():
    from remat_solvers.dp.configs import _save_dominated, enumerate_configs

    problem = builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True)
    seq = analyze(problem)
    readers = set(problem.needed_ids)
    block = max(seq.blocks, key=lambda b: len(enumerate_configs(problem, b, 1 << 20)))
    assert _save_dominated(problem, block, readers)
    pruned = enumerate_configs(problem, block, 1 << 20)
    import remat_solvers.dp.configs as dp
    original = dp._save_dominated
    try:
        dp._save_dominated = lambda *_: []
        full = enumerate_configs(problem, block, 1 << 20)
    finally:
        dp._save_dominated = original
    assert set(pruned) < set(full)


# ---- table building and the front search: faster paths equal the plain ones ----


@pytest.mark.parametrize("make", [
    lambda: builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True),
    lambda: builders.random_dag(10, seed=3, skip_prob=0.3, view_prob=0.3, offload_bandwidth_bytes_per_s=4e8),
])
def test_one_replay_for_every_mode_of_an_untouched_boundary_equals_a_replay_per_mode(make):
    """evaluate_modes derives the other modes of a_{b-1} from one run that never brings a
    dropped a_{b-1} back; every Local (or InvalidLocal) equals evaluate's, mode by mode."""
    from remat_solvers.dp.local import BlockEvaluator
    from remat_solvers.dp.configs import enumerate_configs

    problem = make()
    derived = 0
    for block in analyze(problem).blocks:
        if block.prev is None:
            continue
        evaluator = BlockEvaluator(problem, block)
        modes = problem.allowed(block.prev)
        for config in enumerate_configs(problem, block, 1 << 12)[:400]:
            for delta in (False, True):
                got = evaluator.evaluate_modes(config, modes, delta)
                for mode in modes:
                    try:
                        want = evaluator.evaluate(config, mode, delta)
                    except InvalidLocal:
                        assert isinstance(got[mode], InvalidLocal)
                        continue
                    assert repr(got[mode]) == repr(want)
                    derived += mode is Decision.SAVE and not want.prev_touched and block.prev_read_later
    assert derived > 0  # the derived SAVE run (held to END) was exercised


def test_the_bounded_search_returns_the_plain_optimum_when_runs_are_abandoned(monkeypatch):
    """_cheapest abandons exact runs whose fronts outgrow MAX_FRONT for bounds on finer
    grids; with a coarse first bound (16 points) and every run but the last abandoned,
    it still returns what the plain exact DP (no bounds) finds."""
    import remat_solvers.dp.solver as dp
    from remat_solvers.dp import fronts

    problem = builders.transformer(6, batch=2, seq=64, d_model=32, n_heads=2, vocab=32)
    seq = analyze(problem)
    tables = block_tables(problem, seq, 1 << 14)
    real_run, real_bounds = fronts.run, fronts.completion_bounds
    abandoned = []

    def run(*args, **kw):
        try:
            return real_run(*args, **kw)
        except fronts.FrontTooLarge:
            abandoned.append(kw["max_front"])
            raise

    def bounds(tables, budget, grid, max_grid=1 << 16):  # no exact gcd grid: rounded K
        return real_bounds(tables, budget, grid=grid, max_grid=min(grid, max_grid))

    for fraction in (0.6, 0.7, 0.8):
        budget = builders.with_budget_fraction(problem, fraction).budget_bytes
        plain = real_run(tables, seq.initial_bytes, budget, min_peak=False)
        monkeypatch.setattr(fronts, "run", run)
        monkeypatch.setattr(fronts, "completion_bounds", bounds)
        monkeypatch.setattr(dp, "FIRST_GRID", 16)
        for limit in (-1, dp.MAX_FRONT):
            monkeypatch.setattr(dp, "MAX_FRONT", limit)
            got = dp._cheapest(tables, seq.initial_bytes, budget)
            assert got[1] == pytest.approx(plain[1], rel=1e-12) and got[2] <= budget
        monkeypatch.undo()
    assert abandoned.count(-1) >= 3  # every fraction went through abandoned runs
