"""The torch-free planning types: Node, Problem, Decision, Plan, Evaluation.

A `Problem` is the joint forward+backward graph of one training step as integer node
ids in topological order (parameters/inputs first, then forward, then backward). A
`Plan` decides, for every forward value that backward may need (directly, or through a
recomputation), whether it is kept on the device (SAVE), dropped and recomputed when
backward needs it (RECOMPUTE), or moved to host memory between its last forward use and
its first backward use (OFFLOAD). `simulate.py` is the one memory/compute model.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from types import MappingProxyType

from remat_solvers.layer_structure import LayerStructure


class Phase(enum.Enum):
    """Where a node runs. PARAM and INPUT values are live for the whole step."""

    PARAM = "param"
    INPUT = "input"
    FORWARD = "forward"
    BACKWARD = "backward"


class Decision(enum.Enum):
    """What happens to a forward value between forward and backward."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


class Status(enum.Enum):
    """OPTIMAL: proven best in the solver's plan space. FEASIBLE: fits the budget.
    INFEASIBLE: nothing found fits; the plan is the smallest peak the solver reached."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"


_PHASE_RANK = {Phase.PARAM: 0, Phase.INPUT: 0, Phase.FORWARD: 1, Phase.BACKWARD: 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Node:
    """One value of the joint graph (the output of one op)."""

    name: str
    """Readable name (the fx node name when built from a model)."""
    inputs: tuple[int, ...]
    """Ids of the producers this node reads; each smaller than this node's id."""
    out_bytes: int
    """Bytes of this value's storage (for an alias: its own extent, not counted again)."""
    phase: Phase
    """PARAM/INPUT (live all step), FORWARD or BACKWARD."""
    compute_s: float = 0.0
    """Estimated seconds to run this op once."""
    alias_of: int | None = None
    """Id of the input whose storage this value views (it keeps that storage alive)."""
    recomputable: bool = True
    """False for ops that must never be replayed (random, mutating, collective, ...)."""
    offloadable: bool = True
    """False for values that cannot be moved to host memory."""
    workspace_bytes: int = 0
    """Transient bytes the op allocates and frees inside itself, beyond its output
    (kernel scratch: im2col, oneDNN/cuDNN/cuBLAS workspaces), live only while the op
    runs; counted at every step that runs it (forward, backward or recompute)."""
    save_s: float = 0.0
    """Seconds that saving this value (SAVE) costs when the backward reads it (0 unless
    the cost model charges it). Under inductor a fusible pointwise value that is
    recomputed is never written to memory, while a saved one is written in the forward
    and read back in the backward (cost model "compiled-traffic": 2 x its bytes over the
    bandwidth)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not isinstance(self.workspace_bytes, int) or self.workspace_bytes < 0:
            raise ValueError(f"node {self.name!r}: workspace_bytes must be an int >= 0, got {self.workspace_bytes!r}")
        if not isinstance(self.phase, Phase):
            raise ValueError(f"node {self.name!r}: phase must be a Phase, got {self.phase!r}")
        if not isinstance(self.out_bytes, int) or self.out_bytes < 0:
            raise ValueError(f"node {self.name!r}: out_bytes must be an int >= 0, got {self.out_bytes!r}")
        if not self.compute_s >= 0.0:  # also rejects NaN
            raise ValueError(f"node {self.name!r}: compute_s must be >= 0, got {self.compute_s!r}")
        if not self.save_s >= 0.0:
            raise ValueError(f"node {self.name!r}: save_s must be >= 0, got {self.save_s!r}")
        if self.phase in (Phase.PARAM, Phase.INPUT) and self.inputs:
            raise ValueError(f"node {self.name!r}: a {self.phase.value} node has no inputs, got {self.inputs}")
        if self.alias_of is not None and self.alias_of not in self.inputs:
            raise ValueError(
                f"node {self.name!r}: alias_of={self.alias_of} must be one of its inputs {self.inputs}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """A joint forward+backward graph under a byte budget."""

    nodes: tuple[Node, ...]
    """All values, topologically ordered: PARAM/INPUT, then FORWARD, then BACKWARD."""
    outputs: tuple[int, ...]
    """Values alive at the end of the step (loss, gradients)."""
    budget_bytes: int
    """The peak of live device bytes the step must stay under (inclusive)."""
    offload_bandwidth_bytes_per_s: float | None = None
    """Device<->host link bandwidth; None means OFFLOAD is not allowed."""
    layers: LayerStructure | None = None
    """The repeated layers (which forward node ran in which layer), when the front end
    found them; solvers that use them (`layers`) decline without."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {self.budget_bytes!r}")
        bw = self.offload_bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            raise ValueError(f"offload_bandwidth_bytes_per_s must be > 0 or None, got {bw!r}")
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            if not isinstance(node, Node):
                raise ValueError(f"nodes[{i}] must be a Node, got {type(node).__name__}")
            for j in node.inputs:
                if not isinstance(j, int) or not 0 <= j < i:
                    raise ValueError(
                        f"node {i} ({node.name!r}) reads {j!r}: inputs must be ids of earlier "
                        f"nodes (0..{i - 1}); the nodes must be in topological order without cycles"
                    )
                if _PHASE_RANK[self.nodes[j].phase] > _PHASE_RANK[node.phase]:
                    raise ValueError(
                        f"node {i} ({node.name!r}, {node.phase.value}) reads node {j} "
                        f"({self.nodes[j].name!r}, {self.nodes[j].phase.value}): a later phase "
                        "cannot feed an earlier one"
                    )
            if i and _PHASE_RANK[node.phase] < _PHASE_RANK[self.nodes[i - 1].phase]:
                raise ValueError(
                    f"node {i} ({node.name!r}) is {node.phase.value} after a "
                    f"{self.nodes[i - 1].phase.value} node: order nodes PARAM/INPUT, FORWARD, BACKWARD"
                )
        for j in self.outputs:
            if not isinstance(j, int) or not 0 <= j < n:
                raise ValueError(f"output {j!r} is not a node id (0..{n - 1})")
        if self.layers is not None:
            if not isinstance(self.layers, LayerStructure):
                raise ValueError(f"layers must be a LayerStructure or None, got {type(self.layers).__name__}")
            if len(self.layers.layer_of) != n:
                raise ValueError(f"layers.layer_of has {len(self.layers.layer_of)} entries for {n} nodes")

    # ---- derived structure (cached; the dataclass is frozen so these never go stale) ----

    @functools.cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """users[i]: ids of the nodes that read node i, ascending."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in dict.fromkeys(node.inputs):
                out[j].append(i)
        return tuple(tuple(u) for u in out)

    @functools.cached_property
    def storage_of(self) -> tuple[int, ...]:
        """storage_of[i]: the id whose storage value i lives in (itself unless an alias)."""
        root: list[int] = []
        for i, node in enumerate(self.nodes):
            root.append(i if node.alias_of is None else root[node.alias_of])
        return tuple(root)

    @functools.cached_property
    def forward_ids(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) if n.phase is Phase.FORWARD)

    @functools.cached_property
    def backward_ids(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) if n.phase is Phase.BACKWARD)

    @functools.cached_property
    def needed_ids(self) -> frozenset[int]:
        """Forward values that some backward node reads directly."""
        return frozenset(
            j
            for i in self.backward_ids
            for j in self.nodes[i].inputs
            if self.nodes[j].phase is Phase.FORWARD
        )

    @functools.cached_property
    def save_charged(self) -> tuple[tuple[int, float], ...]:
        """(id, `Node.save_s`) of the values a SAVE decision is charged for: those with a
        save cost that the backward reads (only they are held for it; a never-needed
        value's SAVE and RECOMPUTE are the same schedule), ascending. Empty unless the cost
        model charges saving ("compiled-traffic")."""
        return tuple((j, self.nodes[j].save_s) for j in sorted(self.needed_ids) if self.nodes[j].save_s)

    @functools.cached_property
    def decision_ids(self) -> tuple[int, ...]:
        """Forward values a plan decides: those backward reads, and their forward
        ancestors (which a recomputation may need), ascending."""
        marked = set(self.needed_ids)
        for i in reversed(self.forward_ids):
            if i in marked:
                marked.update(j for j in self.nodes[i].inputs if self.nodes[j].phase is Phase.FORWARD)
        return tuple(sorted(marked))

    def allowed(self, i: int) -> tuple[Decision, ...]:
        """Decisions a plan may take for decision value i. RECOMPUTE is always listed:
        for a non-recomputable value it means "drop", valid only if nothing needs it."""
        node = self.nodes[i]
        out = [Decision.SAVE, Decision.RECOMPUTE]
        if self.offload_bandwidth_bytes_per_s is not None and node.offloadable:
            out.append(Decision.OFFLOAD)
        return tuple(out)

    # ---- offload timing: one constant per value, so exact solvers stay exact ----

    def transfer_s(self, i: int) -> float:
        """Seconds to move value i one way over the device<->host link (0 without one)."""
        bw = self.offload_bandwidth_bytes_per_s
        return self.nodes[i].out_bytes / bw if bw else 0.0

    def store_s(self, i: int) -> float:
        """Exposed seconds of storing value i: the device->host copy starts after its
        last forward use on a side stream and overlaps the forward compute after that
        (`store_overlap_s`); only the rest shows. Link contention between stores is not
        modelled (each store is priced as if the link were free)."""
        return max(0.0, self.transfer_s(i) - self.store_overlap_s[i])

    def reload_s(self, i: int) -> float:
        """Exposed seconds of reloading value i in the canonical schedule: the reload is
        issued just before its first backward reader (no prefetch, so no extra memory),
        which waits for it. (Explicit schedules may issue it earlier: simulate.py.)"""
        return self.transfer_s(i)

    @functools.cached_property
    def store_overlap_s(self) -> tuple[float, ...]:
        """Per node: compute seconds of the forward nodes after its last forward use."""
        nodes = self.nodes
        after = [0.0] * (len(nodes) + 1)  # after[k]: forward compute of ids > k
        for k in range(len(nodes) - 1, -1, -1):
            later = nodes[k + 1].compute_s if k + 1 < len(nodes) and nodes[k + 1].phase is Phase.FORWARD else 0.0
            after[k] = after[k + 1] + later
        out = []
        for i, node in enumerate(nodes):
            if node.phase is not Phase.FORWARD:
                out.append(0.0)
                continue
            last = max((u for u in self.users[i] if nodes[u].phase is Phase.FORWARD), default=i)
            out.append(after[last])
        return tuple(out)

    def with_budget(self, budget_bytes: int) -> Problem:
        return dataclasses.replace(self, budget_bytes=int(budget_bytes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A solver's answer: what to do with each decision value, and what it claims."""

    decisions: Mapping[int, Decision]
    """Exactly `problem.decision_ids` as keys."""
    status: Status
    solver: str
    objective_s: float
    """Claimed extra seconds of the step (recompute + offload transfer), as `simulate` computes."""
    peak_bytes: int
    """Claimed peak live bytes, as `simulate` computes."""
    schedule: tuple[int, ...] | None = None
    """Optional explicit backward order: backward ids once each, forward ids wherever they
    are (re)computed or reloaded; a forward id may appear more than once."""
    lower_bound_s: float | None = None
    """A proven lower bound on the objective over the solver's plan space, if known."""
    solve_s: float = 0.0
    """Wall seconds the solver took (reporting only: no solver decides by the wall clock)."""
    work_s: float = 0.0
    """Deterministic seconds the solver charged to its work clock (`base.WorkClock`):
    what a caller that shares its own limit with this solver subtracts."""

    def __post_init__(self) -> None:
        frozen = MappingProxyType(dict(sorted(self.decisions.items())))
        object.__setattr__(self, "decisions", frozen)
        if self.schedule is not None:
            object.__setattr__(self, "schedule", tuple(self.schedule))
        if not isinstance(self.status, Status):
            raise ValueError(f"status must be a Status, got {self.status!r}")
        for k, d in frozen.items():
            if not isinstance(d, Decision):
                raise ValueError(f"decision for node {k} must be a Decision, got {d!r}")

    def __hash__(self) -> int:
        return hash((tuple(self.decisions.items()), self.schedule, self.status, self.solver))

    def count(self, decision: Decision) -> int:
        return sum(1 for d in self.decisions.values() if d is decision)


class StepKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    RELOAD = "reload"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of an executed schedule: run node `node_id` as `kind`."""

    node_id: int
    kind: StepKind


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What `simulate` computes for a plan."""

    peak_bytes: int
    peak_step: int
    """Index into `steps` where the peak is first reached (-1: before any step)."""
    recompute_s: float
    offload_bytes: int
    offload_s: float
    """Exposed transfer seconds: each store's copy minus the forward compute it overlaps
    (`Problem.store_s`), plus each reload in full (`Problem.reload_s`), or, under an
    explicit schedule, what the backward waits for its reloads (prefetched ones overlap
    the backward steps before their reader; see simulate.py)."""
    steps: tuple[Step, ...]
    timeline: tuple[int, ...]
    """Live device bytes while each step runs (its inputs and its output allocated, plus
    the op's workspace unless the step is a reload)."""
    fits: bool
    recomputed_ids: tuple[int, ...]
    """Forward ids recomputed at least once, ascending."""
    transfer_s: float = 0.0
    """Transfer seconds out and back, in full (hidden or not)."""
    save_s: float = 0.0
    """`Node.save_s` summed over the saved values the backward reads."""

    @property
    def hidden_transfer_s(self) -> float:
        """The part of the transfer that overlaps compute (`transfer_s - offload_s`)."""
        return max(0.0, self.transfer_s - self.offload_s)

    @property
    def cost_s(self) -> float:
        """The objective every solver minimizes: extra seconds over a no-remat step
        (recompute, exposed transfers, and what saving costs where the cost model
        charges it)."""
        return self.recompute_s + self.offload_s + self.save_s


def decisions_all(problem: Problem, decision: Decision) -> dict[int, Decision]:
    """Every decision value set to `decision` (non-recomputable values SAVE instead of
    RECOMPUTE)."""
    out = {}
    for i in problem.decision_ids:
        d = decision
        if d is Decision.RECOMPUTE and not problem.nodes[i].recomputable:
            d = Decision.SAVE
        if d is Decision.OFFLOAD and d not in problem.allowed(i):
            d = Decision.SAVE
        out[i] = d
    return out
