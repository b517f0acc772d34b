"""The zoo models, planned end to end: rematerialized training equals eager training bit
for bit, the measured peak stays under the budget and matches the prediction, and
shrinking the budget buys memory with recomputation (counted in FLOPs). Peaks are
measured with the allocator (`measure_step_profiler`, trusted: the budget is what it
serves) and the tracker (tensor storages, never above the allocator).

Every (model, solver, budget) is planned once per session and shared by the tests below;
each test restores the model's parameters and buffers to their initial values first (in
place, so the planned module keeps the model's own Parameter objects).

Budgets: 100%, 70% and 50% of the no-remat peak; "min": the smallest reachable peak, as
an InfeasibleBudgetError states it; "mid": halfway between min and 100%. On the tiny
models parameters and their gradients dominate the peak, so 70% or 50% is often below
what any plan reaches; then `test_plan_fits_or_states_smallest_peak` asserts the
InfeasibleBudgetError (and its minimum) and the step tests skip, naming that test; "mid"
keeps a feasible budget between the extremes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; never download

import pytest
import torch
from torch._export.utils import _compiling_state_context
import torch.utils._pytree as pytree

import remat
from remat.testing import zoo
from remat.frontend.costs import FlopCounter, flop_counter_mode
from remat.errors import InfeasibleBudgetError
from remat.testing.measure import measure_step, measure_step_profiler
from remat_solvers import Status, solve
from nets import train_step

SOLVER = "chen-greedy"
# (solver, budget): chen-greedy across the budgets; the two extremes where they fit.
KEYS = (
    (SOLVER, "100%"), (SOLVER, "70%"), (SOLVER, "50%"), (SOLVER, "mid"), (SOLVER, "min"),
    ("none", "100%"), ("all", "100%"),
)
MUST_FIT = {(SOLVER, "100%"), (SOLVER, "mid"), (SOLVER, "min"), ("none", "100%")}
STEPS = 3
PEAK_TOLERANCE = 0.03  # |predicted - measured| <= 3% of measured

# Known remat bugs, each a strict xfail so that the fix is noticed (XPASS fails).
# (None open.)
RUN_BUGS: dict = {}  # (model, solver, budget) whose planned step raises
BUDGET_BUGS: dict = {}  # (model, solver, budget) whose measured peak exceeds the budget


def _params(keys, *bugs: dict):
    """pytest params for (model, solver, budget), marked with the known bugs of `bugs`
    (the tables of bugs this test can hit)."""
    out = []
    for name in zoo.NAMES:
        for solver, budget in keys:
            marks = [table[name, solver, budget] for table in bugs if (name, solver, budget) in table][:1]
            out.append(pytest.param(name, solver, budget, marks=marks, id=f"{name}-{solver}-{budget}"))
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# --- planning, once per key ------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Entry:
    """A zoo model planned (or refused) under one solver and budget."""

    case: zoo.ModelCase
    planned: remat.Planned | None
    infeasible: InfeasibleBudgetError | None
    initial_state: dict[str, torch.Tensor]

    def restore(self) -> None:
        """Back to the initial parameters and buffers, in place; no gradients."""
        self.case.model.load_state_dict(self.initial_state)
        for p in self.case.model.parameters():
            p.grad = None

    def require_planned(self) -> remat.Planned:
        if self.planned is None:
            pytest.skip(f"budget infeasible (min peak {self.infeasible.min_peak_bytes} B > "
                        f"{self.infeasible.budget_bytes} B), asserted in "
                        "test_plan_fits_or_states_smallest_peak")
        return self.planned


# key -> (value, None) or (None, the error making it raised)
_ENTRIES: dict[tuple[str, str, str], tuple[Entry | None, Exception | None]] = {}
_MIN_PEAK: dict[str, tuple[int | None, Exception | None]] = {}
_EAGER_FLOPS: dict[str, tuple[int | None, Exception | None]] = {}


def _cached(table: dict, key, make):
    """`make()` once per key; an unexpected error is cached too and re-raised each time."""
    if key not in table:
        try:
            table[key] = (make(), None)
        except Exception as e:  # noqa: BLE001 - re-raised below, for every test of this key
            table[key] = (None, e)
    value, error = table[key]
    if error is not None:
        raise error
    return value


def smallest_peak(name: str) -> int:
    """The smallest reachable peak, as an InfeasibleBudgetError states it: the one of the
    50% budget when that is infeasible (saves a trace), else that of a 1-byte budget."""

    def make():
        half = entry(name, SOLVER, "50%")
        if half.infeasible is not None:
            return half.infeasible.min_peak_bytes
        case = zoo.build(name)
        with pytest.raises(InfeasibleBudgetError) as info:
            remat.plan(case.model, case.args, case.kwargs, budget=1, solver=SOLVER)
        return info.value.min_peak_bytes

    return _cached(_MIN_PEAK, name, make)


def midway(name: str) -> int:
    """Halfway between the smallest reachable peak and the no-remat peak: a budget that is
    feasible and (unless the two meet) tight, on models whose 70% and 50% are not."""
    full = entry(name, SOLVER, "100%").require_planned()
    return (smallest_peak(name) + full.baseline_peak_bytes) // 2


def entry(name: str, solver: str, budget: str) -> Entry:
    def make():
        case = zoo.build(name)
        initial = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
        resolved = {"min": smallest_peak, "mid": midway}.get(budget, lambda _: budget)(name)
        try:
            planned = remat.plan(case.model, case.args, case.kwargs, budget=resolved, solver=solver)
        except InfeasibleBudgetError as e:
            return Entry(case, None, e, initial)
        return Entry(case, planned, None, initial)

    found = _cached(_ENTRIES, (name, solver, budget), make)
    found.restore()
    return found


# --- helpers ---------------------------------------------------------------------------


def _tensor_leaves(out) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def count_flops(fn) -> int:
    with FlopCounter() as counter:
        fn()
    return counter.total_flops


def eager_flops(name: str, case: zoo.ModelCase) -> int:
    return _cached(_EAGER_FLOPS, name, lambda: count_flops(lambda: train_step(copy.deepcopy(case.model), case, 0)))


def recomputes_flop_op(planned: remat.Planned) -> bool:
    """Whether the planned backward reruns a forward op that FlopCounterMode counts."""
    step = planned.step
    registry = flop_counter_mode().flop_registry
    backward = {n.name: n for n in step.backward.graph.nodes if n.op == "call_function"}
    for i in step.evaluation.recomputed_ids:
        for fx_name in step.graph_problem.fx_names[i]:
            node = backward.get(fx_name)
            if node is not None and getattr(node.target, "_overloadpacket", None) in registry:
                return True
    return False


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,solver,budget", _params(KEYS))
def test_plan_fits_or_states_smallest_peak(name, solver, budget):
    e = entry(name, solver, budget)
    reach = smallest_peak(name)
    if e.planned is None:
        assert (solver, budget) not in MUST_FIT, str(e.infeasible)
        assert e.infeasible.min_peak_bytes > e.infeasible.budget_bytes
        assert e.infeasible.min_peak_bytes == reach
        return
    planned, model = e.planned, e.case.model
    expected_budget = {"min": reach, "mid": (reach + planned.baseline_peak_bytes) // 2}.get(
        budget) or remat.resolve_budget(budget, planned.baseline_peak_bytes)
    assert planned.budget_bytes == expected_budget
    assert planned.plan.status is not Status.INFEASIBLE
    assert planned.predicted_peak_bytes <= planned.budget_bytes
    if solver == "none":
        assert planned.predicted_peak_bytes == planned.baseline_peak_bytes
    if budget != "min":
        assert reach <= planned.predicted_peak_bytes
    # The planned module is the model: same keys, the model's own objects.
    assert planned.state_dict().keys() == model.state_dict().keys()
    assert [n for n, _ in planned.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(planned.parameters(), model.parameters(), strict=True))
    assert all(a is b for a, b in zip(planned.buffers(), model.buffers(), strict=True))
    assert planned.summary()


@pytest.mark.parametrize("name,solver,budget", _params(KEYS, RUN_BUGS))
def test_training_matches_eager(name, solver, budget):
    """Outputs and every gradient equal eager's at each step (same seed: same dropout
    masks); parameters and buffers equal after three SGD-with-momentum steps."""
    e = entry(name, solver, budget)
    planned, model, case = e.require_planned(), e.case.model, e.case
    eager = copy.deepcopy(model)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_planned = torch.optim.SGD(planned.parameters(), lr=0.1, momentum=0.9)
    # A model whose eager path branches on tensor values (transformers' packed-sequence
    # check) is traced as torch.export does, with torch.compiler.is_compiling() set; the
    # library then runs another program (an explicit causal mask instead of is_causal),
    # equal to plain eager only up to rounding. The reference is eager on that program.
    reference_state = _compiling_state_context if planned.step.library_trace_path else contextlib.nullcontext
    for k in range(1, STEPS + 1):
        with reference_state():
            out_eager = train_step(eager, case, k)
        out_planned = train_step(planned, case, k)
        leaves_eager, leaves_planned = _tensor_leaves(out_eager), _tensor_leaves(out_planned)
        assert len(leaves_planned) == len(leaves_eager)
        for i, (a, b) in enumerate(zip(leaves_planned, leaves_eager)):
            assert torch.equal(a, b), f"step {k}: output {i} differs"
        for (pname, p_eager), p_planned in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert p_planned.grad is not None, f"step {k}: no gradient for {pname}"
            assert torch.equal(p_planned.grad, p_eager.grad), f"step {k}: gradient of {pname} differs"
        opt_eager.step()
        opt_planned.step()
        opt_eager.zero_grad(set_to_none=True)
        opt_planned.zero_grad(set_to_none=True)
    state_eager, state_planned = eager.state_dict(), model.state_dict()
    assert state_planned.keys() == state_eager.keys()
    for key, value in state_eager.items():
        assert torch.equal(state_planned[key], value), f"after {STEPS} steps: {key} differs"
    changed = [k for k, v in state_planned.items() if not torch.equal(v, e.initial_state[k])]
    assert changed, "the optimizer steps changed nothing; the comparison would be vacuous"


EAGER_PATH_MODELS = ("mlp", "cnn", "bert", "vit", "resnet")


@pytest.mark.parametrize("name", zoo.NAMES)
def test_which_models_trace_on_their_eager_path(name):
    """The models compared with plain eager above are exactly these; gpt2 and llama
    branch on tensor values in transformers' masking code and are traced on its compile path."""
    planned = entry(name, "none", "100%").require_planned()
    assert (planned.step.library_trace_path == "") == (name in EAGER_PATH_MODELS)
    if name not in EAGER_PATH_MODELS:
        assert "masking_utils.py" in planned.step.library_trace_path
        assert "traced with torch.compiler.is_compiling() set" in planned.summary()


@dataclasses.dataclass(frozen=True)
class Peaks:
    allocator: int
    """`measure_step_profiler`: every byte the allocator serves, kernel scratch included
    (what the budget means: `torch.cuda.max_memory_allocated`); autograd runs unperturbed."""
    tracker: int
    """`measure_step` (dispatch mode): live tensor storages only."""


_PEAKS: dict[tuple[str, str, str], tuple[Peaks | None, Exception | None]] = {}


def _measured_peaks(name: str, solver: str, budget: str) -> Peaks:
    """Both instruments on one planned step, measured once per key (shared by the tests
    below: the profiler costs more than the tracker)."""
    e = entry(name, solver, budget)
    planned, case = e.require_planned(), e.case
    register = (case.model, *case.args, *case.kwargs.values())

    def make():
        allocator = measure_step_profiler(lambda: train_step(planned, case, 0), register=register).peak_bytes
        e.restore()
        tracker = measure_step(lambda: train_step(planned, case, 0), register=register).peak_bytes
        e.restore()
        return Peaks(allocator=allocator, tracker=tracker)

    return _cached(_PEAKS, (name, solver, budget), make)


@pytest.mark.parametrize("name,solver,budget", _params(KEYS, RUN_BUGS))
def test_measured_peak_matches_prediction(name, solver, budget):
    """The prediction is never below the allocator's peak and within 3% of it: the
    allocator is trusted, since the budget is what it serves (op workspace included,
    measured by `remat.plan` by default). The tracker sees tensor storages only, a subset
    of the allocator's bytes on the planned step (tied weights' gradients are summed in
    the planned backward, so the dispatch mode's out-of-place sums do not arise)."""
    e = entry(name, solver, budget)
    peaks, predicted = _measured_peaks(name, solver, budget), e.planned.predicted_peak_bytes
    assert peaks.allocator <= predicted <= (1 + PEAK_TOLERANCE) * peaks.allocator, (
        f"predicted {predicted} B vs allocator {peaks.allocator} B: off by "
        f"{100 * (predicted - peaks.allocator) / peaks.allocator:+.2f}%")
    # The tracker cross-checks the allocator within the same 3%, not to the byte: it can
    # read a little above the allocator (LLaMA with no remat: 0.5%, cause unknown).
    # Out-of-place sums of tied weights' gradients, the error this check exists for, read
    # 3.7-13% above.
    assert peaks.tracker <= (1 + PEAK_TOLERANCE) * peaks.allocator, (
        f"tracker {peaks.tracker} B > allocator {peaks.allocator} B by more than 3%")


@pytest.mark.parametrize("name,solver,budget", _params(KEYS, RUN_BUGS, BUDGET_BUGS))
def test_measured_peak_within_budget(name, solver, budget):
    """The allocator's peak (the budget's own definition) stays under the budget."""
    e = entry(name, solver, budget)
    measured = _measured_peaks(name, solver, budget).allocator
    assert measured <= e.planned.budget_bytes, (
        f"allocator peak {measured} B > budget {e.planned.budget_bytes} B "
        f"(predicted {e.planned.predicted_peak_bytes} B)")


_FULL_BUDGET = ((SOLVER, "100%"), ("none", "100%"))


@pytest.mark.parametrize("name,solver,budget", _params(_FULL_BUDGET, RUN_BUGS))
def test_no_extra_flops_at_full_budget(name, solver, budget):
    e = entry(name, solver, budget)
    planned, case = e.require_planned(), e.case
    problem = planned.step.graph_problem.problem
    # only views are recomputed (a saved value's views come from it: solvers.shared_storage)
    assert all(problem.nodes[i].alias_of is not None for i in planned.step.evaluation.recomputed_ids)
    assert count_flops(lambda: train_step(planned, case, 0)) == eager_flops(name, case)


def _monotone_params():
    out = []
    for name in zoo.NAMES:
        marks = [mark for (n, _, _), mark in RUN_BUGS.items() if n == name][:1]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _monotone_params())
def test_flops_grow_as_budget_shrinks(name):
    """chen-greedy over the feasible budgets, largest first: FLOPs never fall, and the
    smallest budget costs strictly more than 100% when it reruns a counted op. The `all`
    plan costs at least as much as the full budget."""
    runs = []
    for solver, budget in KEYS:
        e = entry(name, solver, budget)
        if e.planned is not None:
            flops = count_flops(lambda: train_step(e.planned, e.case, 0))
            runs.append((solver, budget, e.planned, flops))
    greedy = sorted((r for r in runs if r[0] == SOLVER), key=lambda r: -r[2].budget_bytes)
    assert greedy[0][1] == "100%" and greedy[-1][1] == "min"
    base = eager_flops(name, entry(name, SOLVER, "100%").case)
    assert greedy[0][3] == base
    # The chain compares chen-greedy's own answers. Where chen-greedy finds no plan that
    # fits (at "min", the floor), the planner falls back to the floor plan
    # (remat.planning.floor.at_the_floor), which comes from another search and can rerun fewer
    # FLOPs than chen-greedy's plan at a larger budget (measured on vit in CI).
    own = [r for r in greedy if solve(r[2].step.graph_problem.problem, SOLVER).status is not Status.INFEASIBLE]
    assert own[0] is greedy[0]
    for (_, b1, p1, f1), (_, b2, p2, f2) in zip(own, own[1:]):
        assert f2 >= f1, f"budget {b2} ({p2.budget_bytes} B) used {f2} FLOPs < {f1} at {b1}"
    smallest = greedy[-1][2]
    if recomputes_flop_op(smallest):
        assert greedy[-1][3] > base
    if smallest.predicted_peak_bytes < greedy[0][2].predicted_peak_bytes:
        assert smallest.step.evaluation.recomputed_ids, "a lower peak without recomputing anything"
    for solver, budget, planned, flops in runs:
        if solver == "all":
            assert flops >= base
            if recomputes_flop_op(planned):
                assert flops > base
