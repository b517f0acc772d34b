"""dp's table building: each faster path gives exactly what the plain one gives (the same
options in the same order, the same Locals), on random data and on real blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import Decision
from solvers.dp.fronts import Option
from solvers.dp.local import NEG, Local, Terms

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
    from solvers.dp.tables import _option_vector, _prune_options, _prune_plain

    opts = [Option((Decision.SAVE,) * k, data.draw(locals_(cascade)), None, False) for k in range(n)]
    ordered = sorted(opts, key=_option_vector)
    want = _prune_plain(ordered, [_option_vector(o) for o in ordered])
    assert [id(o) for o in _prune_options(opts)] == [id(o) for o in want]
