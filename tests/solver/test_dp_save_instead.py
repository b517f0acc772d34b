"""dp's second exact skip of configurations (solvers/dp/exchange.py): a configuration
that recomputes a value from private saved values is never better than saving the
value instead. Oracles: the tables built with and without the skip are identical (same
options, same order, same Locals); dp equals brute where it fires; on LLaMA's traced
attention block every skipped configuration's options are no better, component by
component, than those of the configuration it names."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat_solvers import Phase, solve
from remat_solvers.base import WorkClock
from remat_solvers.dp.configs import enumerate_configs
from remat_solvers.dp.exchange import save_instead_mask, save_instead_test
from remat_solvers.dp.fronts import DROPPED, Option
from remat_solvers.dp.local import BlockEvaluator, InvalidLocal
from remat_solvers.dp.structure import analyze
from remat_solvers.dp.tables import _IDENTITY, _option_vector, _table
from oracles import assert_equals_brute
from strategies import COSTS


@st.composite
def rotary_blocks(draw, layers: int = 2, links: int = 4):
    """Residual layers like LLaMA's attention: a normed input read by backward, and from
    it private chains (links, diamonds: x1 = mm(h), x2 = neg(x1), x3 = cat(x2, x1), ...)
    ending in a value backward reads, with random bytes, costs and backward reads."""
    from remat_solvers.builders import FwdOp, joint_from_forward
    from strategies import peaks

    sizes, small = st.sampled_from([8, 16, 32, 64]), st.sampled_from([8, 8, 16, 32])
    ops = [FwdOp(name="x", out_bytes=64, phase=Phase.INPUT, requires_grad=True),
           FwdOp(name="w", out_bytes=16, phase=Phase.PARAM)]
    h = 0
    for layer in range(draw(st.integers(1, layers))):
        norm = len(ops)
        ops.append(FwdOp(name=f"norm{layer}", out_bytes=draw(sizes), inputs=(h, 1), compute_s=0.25,
                         grad_reads=(len(ops),)))
        ends = []
        for chain in range(draw(st.integers(1, 2))):
            start = len(ops)
            ops.append(FwdOp(name=f"mm{layer}{chain}", out_bytes=draw(sizes), inputs=(norm, 1),
                             compute_s=draw(st.sampled_from(COSTS)), grad_reads=(norm,)))
            n_links = draw(st.integers(1, links))
            for k in range(n_links):
                v = len(ops)
                shape = draw(st.integers(0, 2))  # a link, a diamond over the last two, a read of the start
                inputs = (v - 1,) if shape == 0 or v - 2 < start else (v - 1, v - 2) if shape == 1 else (v - 1, start)
                last = k == n_links - 1  # often small: then saving it instead is cheap
                ops.append(FwdOp(name=f"r{layer}{chain}{k}", out_bytes=draw(small if last else sizes), inputs=inputs,
                                 compute_s=draw(st.sampled_from(COSTS)),
                                 grad_reads=draw(st.sampled_from([(), (), inputs[:1]]))))
            ends.append(len(ops) - 1)
        ops.append(FwdOp(name=f"attn{layer}", out_bytes=64, inputs=tuple(ends), compute_s=0.5,
                         grad_reads=tuple(ends)))
        ops.append(FwdOp(name=f"add{layer}", out_bytes=64, inputs=(h, len(ops) - 1), compute_s=0.125,
                         grad_alias=True))
        h = len(ops) - 1
    ops.append(FwdOp(name="loss", out_bytes=4, inputs=(h,), compute_s=0.5, grad_reads=(h,)))
    problem = joint_from_forward(ops)
    lo, hi = sorted(peaks(problem))
    return problem.with_budget(draw(st.one_of(st.integers(lo, hi), st.integers(lo * 4 // 5, lo))))


def _fires(problem) -> int:
    """How many configurations the rule skips; each names a tabulated one, and the
    numpy mask agrees with the rule one configuration at a time."""
    n = 0
    for block in analyze(problem).blocks:
        better = save_instead_test(problem, block)
        configs = enumerate_configs(problem, block, 1 << 16)
        names = [better(config) for config in configs]
        assert save_instead_mask(problem, block, configs).tolist() == [y is not None for y in names]
        for config, y in zip(configs, names):
            if y is not None:
                assert y in configs and y != config  # the configuration it names is tabulated
                n += 1
    return n


def _tables(problem, monkeypatch, skip: bool) -> list:
    import remat_solvers.dp.tables as tables

    if not skip:
        monkeypatch.setattr(tables, "save_instead_mask", lambda problem, block, configs: [False] * len(configs))
    out = []
    for block in analyze(problem).blocks:
        (table,), _ = _table(problem, block, [_IDENTITY], 1 << 16, WorkClock(None))
        out.append({ctx: [(o.config, repr(o.local), o.mode, o.delta) for o in opts] for ctx, opts in table.items()})
    monkeypatch.undo()
    return out


@settings(max_examples=60)
@given(data=st.data(), bandwidth=st.sampled_from([None, None, 40.0, 400.0]))
def test_skipping_keeps_every_table_identical(data, bandwidth):
    """With and without an offload link (offloaded values never count as private;
    smaller layers then: three decisions per value)."""
    import dataclasses

    problem = data.draw(rotary_blocks() if bandwidth is None else rotary_blocks(layers=1, links=2))
    problem = dataclasses.replace(problem, offload_bandwidth_bytes_per_s=bandwidth)
    with pytest.MonkeyPatch.context() as mp:
        assume(_fires(problem))
        assert _tables(problem, mp, skip=True) == _tables(problem, mp, skip=False)


@settings(max_examples=40, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(problem=rotary_blocks(layers=1, links=3))
def test_skipping_keeps_dp_equal_to_brute(problem):
    assume(_fires(problem))
    assert_equals_brute(problem, solve(problem, "dp"))


@pytest.mark.parametrize(("name", "share"), [("llama", 0.5), ("gpt2", 0.15)])
def test_skipped_traced_attention_configurations_are_no_better_component_by_component(name, share):
    """The traced attention blocks (LLaMA: its rotary chains; GPT-2: the
    query/key/value split): a share of their configurations is skipped, and for a spread
    of them, in every context, the skipped configuration's replay fails where the named
    one fails, has the same outcome key, and no lower option vector (a higher cost)."""
    from test_dp_fast import _layers_blocks, _traced_problem

    red, fixed, blocks = next(iter(_layers_blocks(_traced_problem(name))))
    block = max(blocks, key=lambda b: len(b.values))
    configs = enumerate_configs(red, block, 1 << 17)
    better = save_instead_test(red, block)
    names = [better(x) for x in configs]
    assert save_instead_mask(red, block, configs).tolist() == [y is not None for y in names]
    pairs = [(x, y) for x, y in zip(configs, names) if y is not None]
    assert len(pairs) > share * len(configs)
    ev = BlockEvaluator(red, block, fixed)
    modes = red.allowed(block.prev)
    for x, y in pairs[::max(1, len(pairs) // 150)]:
        mode_b = x[-1]
        for delta in (False, True) if mode_b in DROPPED else (False,):
            xs, ys = ev.evaluate_modes(x, modes, delta), ev.evaluate_modes(y, modes, delta)
            for mode in modes:
                if isinstance(ys[mode], InvalidLocal):
                    assert isinstance(xs[mode], InvalidLocal)
                    continue
                lx, ly = xs[mode], ys[mode]
                assert (lx.prev_touched, lx.cascade_nested) == (ly.prev_touched, ly.cascade_nested)
                vx = _option_vector(Option(x, lx, mode_b, delta))
                vy = _option_vector(Option(y, ly, mode_b, delta))
                assert len(vx) == len(vy) and all(a >= b for a, b in zip(vx, vy)) and vx[0] > vy[0]
