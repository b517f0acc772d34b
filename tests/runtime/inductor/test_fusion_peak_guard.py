"""The `peak` fusion rule (remat.runtime.inductor.fusion._PeakGuard) on hand-made
schedules: a fusion of kernels far apart moves what the later kernel allocates, and what
inductor's topological sort pulls up with it (its ancestors that ran in between), to the
first kernel's place; it is allowed only when no position in between then goes over the
graph's peak before fusion, and fusions already made count. The end-to-end checks (the
measured peak under inductor equals the prediction with this rule) are in
test_inductor_budget.py and test_inductor_saved_views.py."""

from dataclasses import dataclass, field

from remat.runtime.inductor.fusion import _PeakGuard


@dataclass(eq=False)
class Buf:
    size: int

    @property
    def mpi_buffer(self):
        return self


Buf.size_alloc = property(lambda self: self.size)


@dataclass(eq=False)
class Node:
    name: str
    order: int
    size: int
    ancestors: set = field(default_factory=set)

    def get_name(self):
        return self.name

    def get_nodes(self):
        return [self]

    def get_outputs(self):
        return [Buf(self.size)]

    @property
    def min_order(self):
        return self.order

    max_order = min_order


def _schedule(sizes, live, ancestors=None):
    ancestors = ancestors or {}
    nodes = [Node(f"n{i}", i, s, set(ancestors.get(i, ()))) for i, s in enumerate(sizes)]
    return nodes, _PeakGuard(nodes, list(live))


def test_a_fusion_under_the_peak_is_allowed_and_one_over_it_is_not():
    # live bytes per position; the peak (100) is at the end
    nodes, guard = _schedule([10, 30, 10, 20, 10], [10, 40, 50, 70, 100])
    assert guard.cap == 100
    assert guard.fits(nodes[0], nodes[3])  # 20 B more at positions 0-2: 30, 60, 70
    nodes, guard = _schedule([10, 30, 10, 40, 10], [10, 40, 70, 70, 100])
    assert not guard.fits(nodes[0], nodes[3])  # 40 B more at position 2: 110 > 100


def test_ancestors_pulled_up_count_and_earlier_ones_do_not():
    # n3 needs n2 (between n0 and n3): fusing n0 with n3 runs n2 before n0 as well
    nodes, guard = _schedule([5, 5, 30, 10, 5], [60, 65, 95, 90, 100], ancestors={3: {"n2", "n0"}})
    extra = dict(guard._extra(nodes[0], nodes[3]))
    assert extra == {0: 40, 1: 40, 2: 10}
    assert not guard.fits(nodes[0], nodes[3])  # 65 + 40 > 100
    nodes, guard = _schedule([5, 5, 30, 10, 5], [60, 65, 85, 90, 100], ancestors={3: {"n0"}})
    assert dict(guard._extra(nodes[0], nodes[3])) == {0: 10, 1: 10, 2: 10}
    assert guard.fits(nodes[0], nodes[3])


def test_fusions_already_made_use_up_the_room():
    nodes, guard = _schedule([10, 10, 40, 55, 0], [10, 20, 40, 95, 100])
    assert guard.fits(nodes[0], nodes[2])  # 40 more at 0-1: 50, 60
    assert guard.fits(nodes[1], nodes[3])  # 55 more at 1-2: 75, 95
    guard.commit(nodes[0], nodes[2])
    assert guard.live == [50, 60, 40, 95, 100]
    assert not guard.fits(nodes[1], nodes[3])  # now 60 + 55 at position 1


def test_a_node_the_order_before_fusion_does_not_know_is_not_fused_far():
    nodes, guard = _schedule([10, 10, 10], [10, 20, 30])
    stranger = Node("made_later", 2, 0)
    assert not guard.fits(nodes[0], stranger)
    assert guard.fits(nodes[0], nodes[2])
