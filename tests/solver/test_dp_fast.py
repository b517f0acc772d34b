"""dp's table building: each faster path gives exactly what the plain one gives (the same
options in the same order, the same Locals), on random data and on real blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat_solvers import Decision, Phase
from remat_solvers.dp.fronts import Option
from remat_solvers.dp.local import NEG, InvalidLocal, Local, Terms
from test_dp import feeder_chains  # random chains with non-recomputable values

_SMALL = st.sampled_from([NEG, 0, 1, 2, 3, 5])


@st.composite
def locals_(draw, cascade: bool) -> Local:
    def terms() -> Terms:
        return Terms(*(draw(_SMALL) for _ in range(4)))

    return Local(cost_s=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])), peak_forward=draw(st.integers(0, 3)),
                 peak_backward=terms(), keep_bytes=draw(st.integers(0, 3)), prev_touched=False,
                 cascade=terms() if cascade else None, cascade_net=draw(st.integers(0, 3)),
                 cascade_freed=draw(st.integers(0, 2)))


@settings(max_examples=200)
@given(data=st.data(), cascade=st.booleans(), n=st.integers(0, 60))
def test_pruning_options_with_numpy_keeps_what_the_pairwise_loop_keeps(data, cascade, n):
    """Few distinct values per component: many ties and equal vectors, -inf terms."""
    from remat_solvers.dp.tables import _option_vector, _prune_options, _prune_plain

    opts = [Option((Decision.SAVE,) * k, data.draw(locals_(cascade)), None, False) for k in range(n)]
    ordered = sorted(opts, key=_option_vector)
    want = [ordered[k] for k in _prune_plain([_option_vector(o) for o in ordered])]
    assert [id(o) for o in _prune_options(opts)] == [id(o) for o in want]


# ---- canonical forms: one pass tabulates every block of one form ----


def _layers_blocks(problem):
    """(reduced problem, fixed values, blocks) of both models `layers` tabulates."""
    from remat_solvers.dp.structure import analyze
    from remat_solvers.layers import _behind, fold_views, kept_values

    kept = kept_values(problem)
    for k, early in ((frozenset(), True), (kept, False)):
        red = fold_views(problem, k)
        kept_red = frozenset(red.reduced_id(v) for v in kept)
        fixed = _behind(red.problem, kept_red)
        release = frozenset(red.problem.storage_of[v] for v in kept_red) if early else frozenset()
        yield red.problem, fixed, analyze(red.problem, fixed=fixed, release_early=release).blocks


def _assert_forms_shift_exactly(problem, fixed, blocks, per_block: int = 160) -> tuple[int, int]:
    """For every block and a spread of its configurations: evaluate_modes gives each
    mode's own replay (evaluate), and the canonical form's Locals, shifted, are the
    block's own (repr: every field, ints as ints), mode by mode, and the shifted option
    vector is the shifted Local's. Returns (signatures, canonical forms)."""
    from remat_solvers.dp.configs import enumerate_configs
    from remat_solvers.dp.fronts import DROPPED
    from remat_solvers.dp.local import BlockEvaluator
    from remat_solvers.dp.tables import _Form, _option_vector

    sigs, canons = set(), set()
    for block in blocks:
        form = _Form.of(problem, block)
        sigs.add(form.sig)
        canons.add(form.canon_sig)
        canon = BlockEvaluator(problem, form.canon, fixed, prev_workspace=0)
        direct = BlockEvaluator(problem, form.block, fixed)
        modes = problem.allowed(block.prev) if block.prev is not None else (None,)
        configs = enumerate_configs(problem, form.canon, 1 << 17)
        for config in configs[::max(1, len(configs) // per_block)]:
            mode_b = config[-1] if block.boundary is not None else None
            for delta in (False, True) if mode_b in DROPPED else (False,):
                got, want = canon.evaluate_modes(config, modes, delta), direct.evaluate_modes(config, modes, delta)
                for mode in modes:
                    try:  # evaluate_modes derives modes from one run: each equals its own replay
                        alone = direct.evaluate(config, mode, delta)
                    except InvalidLocal:
                        assert isinstance(want[mode], InvalidLocal) and isinstance(got[mode], InvalidLocal)
                        continue
                    assert repr(want[mode]) == repr(alone)
                    shifted = form.shift.local(got[mode])
                    assert repr(shifted) == repr(want[mode])
                    opt = Option(config, got[mode], mode_b, delta)
                    assert form.shift.vector(_option_vector(opt)) == _option_vector(
                        Option(config, shifted, mode_b, delta))
    return len(sigs), len(canons)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_traced_first_layers_share_the_other_layers_canonical_form(name):
    """GPT-2's layer 0 differs from the others in a_{b-1}'s workspace (the embedding
    dropout's replay), LLaMA's in the mask and rotary steps before it: the shifted
    canonical Locals are exactly theirs, and fewer forms than signatures are tabulated."""
    import remat
    from remat.testing import zoo

    case = zoo.build(name)
    problem = remat.plan(case.model, case.args, case.kwargs, budget="100%", solver="none").problem
    shared = 0
    for red, fixed, blocks in _layers_blocks(problem):
        n_sigs, n_canons = _assert_forms_shift_exactly(red, fixed, blocks)
        shared += n_sigs - n_canons
    assert shared >= 1


def test_a_workspace_on_the_boundary_shifts_exactly_on_random_stacks():
    """Boundaries given random recompute workspaces (and a few leading steps that only
    read parameters): every block's shifted canonical Locals equal its own."""
    import dataclasses
    import random

    from remat_solvers import builders
    from remat_solvers.dp.structure import analyze

    for seed in range(3):
        problem = builders.transformer(3, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=seed > 0)
        rng = random.Random(seed)
        cuts = {b.boundary for b in analyze(problem).blocks if b.boundary is not None}
        nodes = tuple(dataclasses.replace(n, workspace_bytes=rng.choice([0, 8, 4096])) if i in cuts else n
                      for i, n in enumerate(problem.nodes))
        problem = dataclasses.replace(problem, nodes=nodes)
        assert _assert_forms_shift_exactly(problem, frozenset(), analyze(problem).blocks)[0] >= 2


def _stack_with_prefixes(junk: tuple[int, ...], workspace: tuple[int, ...], budget: float):
    """A residual stack whose layers start with a dead op reading only a parameter
    (`junk` bytes: a stripped prefix whose static bytes can exceed the rest), the
    boundaries given recompute workspaces."""
    import dataclasses

    from remat_solvers import builders
    from remat_solvers.builders import FwdOp, joint_from_forward

    ops = [FwdOp(name="x", out_bytes=64, phase=Phase.INPUT, requires_grad=True),
           FwdOp(name="w", out_bytes=16, phase=Phase.PARAM)]
    h = 0
    for k, size in enumerate(junk):
        ops.append(FwdOp(name=f"junk{k}", out_bytes=size, inputs=(1,), compute_s=0.125, differentiable=False))
        a = len(ops)
        ops.append(FwdOp(name=f"a{k}", out_bytes=96, inputs=(h, 1), compute_s=0.5, grad_reads=(h, 1)))
        ops.append(FwdOp(name=f"b{k}", out_bytes=64, inputs=(a,), compute_s=0.25, grad_reads=(a,)))
        ops.append(FwdOp(name=f"h{k}", out_bytes=64, inputs=(h, a + 1), compute_s=0.125, grad_alias=True))
        h = len(ops) - 1
    ops.append(FwdOp(name="loss", out_bytes=4, inputs=(h,), compute_s=0.5, grad_reads=(h,)))
    problem = joint_from_forward(ops)
    boundaries = [i for i, n in enumerate(problem.nodes) if n.name.startswith("h")]
    nodes = list(problem.nodes)
    for i, w in zip(boundaries, workspace):
        nodes[i] = dataclasses.replace(nodes[i], workspace_bytes=w)
    return builders.with_budget_fraction(dataclasses.replace(problem, nodes=tuple(nodes)), budget)


@pytest.mark.parametrize("budget", [0.6, 0.75, 1.0])
def test_stripped_prefixes_and_workspaces_keep_dp_equal_to_brute(budget):
    """Layers whose stripped prefix sets the forward peak (the floor binds) and whose
    boundaries have distinct workspaces: their shifted Locals are their own, they share
    one canonical form, and dp still equals brute."""
    from remat_solvers import solve
    from remat_solvers.dp.local import BlockEvaluator
    from remat_solvers.dp.structure import analyze
    from remat_solvers.dp.tables import _Form
    from oracles import assert_equals_brute

    problem = _stack_with_prefixes((4096, 8, 2048, 4096, 16), (0, 512, 64, 64, 64), budget)
    blocks = analyze(problem).blocks
    n_sigs, n_canons = _assert_forms_shift_exactly(problem, frozenset(), blocks)
    assert n_canons < n_sigs
    binds = 0
    for block in blocks:
        form = _Form.of(problem, block)
        if form.shift.forward_floor is not None:
            ev = BlockEvaluator(problem, form.canon, prev_workspace=0)
            config = tuple(Decision.SAVE for _ in block.values)
            mode = problem.allowed(block.prev)[0] if block.prev is not None else None
            binds += ev.evaluate(config, mode, False).peak_forward + form.shift.forward_shift < form.shift.forward_floor
    assert binds >= 1
    assert_equals_brute(problem, solve(problem, "dp"))


def _traced_problem(name: str):
    import remat
    from remat.testing import zoo

    case = zoo.build(name)
    return remat.plan(case.model, case.args, case.kwargs, budget="100%", solver="none").problem


@pytest.mark.parametrize("source", ["gpt2", "dropout-stack", "random"])
def test_doomed_configurations_raise_in_every_mode_and_cascade(source):
    """Configurations the tables skip as doomed: every replay (each mode of a_{b-1},
    with and without the boundary's cascade) raises InvalidLocal; on GPT-2 (RNG replay:
    non-recomputable generator states read by recomputed dropouts) the test fires. And
    the test is exact: with a_{b-1} saved and no cascade, the others replay."""
    from remat_solvers import builders
    from remat_solvers.dp.configs import doomed_test, enumerate_configs
    from remat_solvers.dp.local import BlockEvaluator
    from remat_solvers.dp.structure import analyze

    if source == "gpt2":
        cases = [(red, fixed, blocks) for red, fixed, blocks in _layers_blocks(_traced_problem("gpt2"))][:1]
    else:
        problem = (builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True)
                   if source == "dropout-stack" else builders.random_dag(12, seed=5, skip_prob=0.3, view_prob=0.2))
        cases = [(problem, frozenset(), analyze(problem).blocks)]
    fired = 0
    for problem, fixed, blocks in cases:
        for block in blocks:
            doomed = doomed_test(problem, block)
            evaluator = BlockEvaluator(problem, block, fixed)
            modes = problem.allowed(block.prev) if block.prev is not None else (None,)
            configs = enumerate_configs(problem, block, 1 << 17)
            first = Decision.SAVE if block.prev is not None else None
            for config in configs[::max(1, len(configs) // 400)]:
                if not doomed(config):  # then the plain run (a_{b-1} saved, no cascade) is valid
                    evaluator.evaluate(config, first, False)
                    continue
                fired += 1
                for delta in (False, True):
                    out = evaluator.evaluate_modes(config, modes, delta)
                    assert all(isinstance(out[m], InvalidLocal) for m in modes)
    assert fired > 0 or source != "gpt2"


@settings(max_examples=60)
@given(data=st.data())
def test_doomed_is_exactly_the_plain_run_failing_on_random_chains(data):
    """Chains with non-recomputable values that backward may not read (so dropping them
    is valid unless a recomputation needs them): doomed(config) holds exactly when the
    plain run (a_{b-1} saved, no cascade) raises, and then every run raises."""
    from remat_solvers.dp.configs import doomed_test, enumerate_configs
    from remat_solvers.dp.local import BlockEvaluator
    from remat_solvers.dp.structure import analyze

    problem = data.draw(feeder_chains())
    for block in analyze(problem).blocks:
        doomed = doomed_test(problem, block)
        evaluator = BlockEvaluator(problem, block)
        modes = problem.allowed(block.prev) if block.prev is not None else (None,)
        first = Decision.SAVE if block.prev is not None else None
        for config in enumerate_configs(problem, block, 1 << 12):
            try:
                evaluator.evaluate(config, first, False)
            except InvalidLocal:
                assert doomed(config)
                for delta in (False, True):
                    out = evaluator.evaluate_modes(config, modes, delta)
                    assert all(isinstance(out[m], InvalidLocal) for m in modes)
            else:
                assert not doomed(config)


@settings(max_examples=200)
@given(data=st.data(), n=st.integers(0, 300), beam=st.integers(1, 20), width=st.integers(1, 5))
def test_the_beam_front_is_the_front_ordered_by_score_and_cut(data, n, beam, width):
    """beam_front == pareto, stably sorted by a score that dominance never increases
    (cost plus a nondecreasing function of K, as run's beam scores rows), cut to `beam`;
    few distinct values per column: many ties and equal rows."""
    import numpy as np

    from remat_solvers.dp.pareto import beam_front, pareto

    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    x = rng.integers(0, 4, size=(n, width)).astype(float)
    if width > 2:
        x[rng.random(n) < 0.2, 2] = -np.inf
    step = np.cumsum(rng.integers(0, 2, size=5)).astype(float)
    step[-1] = np.inf if data.draw(st.booleans()) else step[-1]
    score = x[:, 0] + step[np.minimum(x[:, min(1, width - 1)], 4).astype(int)] if n else np.zeros(0)
    want = pareto(x) if n else np.zeros(0, np.int64)
    if len(want) > beam:
        want = want[np.argsort(score[want], kind="stable")[:beam]]
    assert beam_front(x, score, beam).tolist() == want.tolist()
