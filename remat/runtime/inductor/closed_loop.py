"""The closed loop between remat's plan and inductor's generated code (`plan_under_fusion`).

remat plans op by op; inductor runs the plan fused (`estimate`: what its generated code
holds against the same graph op by op, per graph). Where the code holds more, remat
plans again under the budget less that margin; where it holds less (fusion never
allocates what it inlines), remat tries a plan under the budget plus the room, and keeps
it when it costs less and its own prediction fits. The step records the margin it ran
with; the prediction is remat's peak plus it (`estimate.inductor_peak_bytes`). Where no
plan tried fits, the smallest reachable peak is the lowest under inductor of remat's
floor, the plan at the no-remat peak, the floor of the plans that recompute each value
once, both floors solved as inductor's lowering inlines pointwise values
(`remat.planning.inlining`), and the second of those without the floor search's descent
(`PlannerSettings.descend_floor`): each is lowest on some model. The lowest of them is
also estimated under the other lowerings (neighbour fusion, layout optimization off;
`FALLBACK_RULES`, `_layout_alternative`), even where inductor's code holds less than
remat's model: at the floor no replan is left.

A percentage is of the no-remat peak of the path that runs: inductor's, remat's plan that
saves everything as inductor generates it (so "100%" always plans). The whole-step
ledger's first step plans best effort: where nothing found fits its share, the call runs
the lowest plan found under inductor instead of being refused (the ledger splits the
budget once the step is known), unless that plan alone is over a budget given in bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from remat.budget import format_bytes, is_percentage, resolve_budget
from remat.errors import InfeasibleBudgetError
from remat.runtime.inductor.estimate import GraphBytes, estimate_fusion, inductor_peak_bytes

log = logging.getLogger(__name__)


MAX_REPLANS = 3
"""Replans after the first plan; each lowers the target by the largest margin seen, so
the target only falls and the loop ends (measured: one replan on every model tried)."""


def _refusal(budget_bytes: int, peak_bytes: int, margin: int) -> Exception:
    need = peak_bytes + margin
    return InfeasibleBudgetError(
        f"budget {format_bytes(budget_bytes)} does not hold under inductor: the smallest "
        f"reachable peak found is {format_bytes(need)}, by the plan that peaks lowest under "
        f"inductor of those tried (down to remat's floor and the floor of the plans that recompute each "
        f"value once, each op by op and as inductor inlines pointwise values, and the plan at the "
        f"no-remat peak): "
        f"{format_bytes(peak_bytes)} op by op, {margin:+,} B from inductor's kernels (generated "
        f"code vs op by op); raise the budget to at least {need} bytes, or use "
        "compiler='eager' (op by op, no fusion)", budget_bytes=budget_bytes, min_peak_bytes=need)


@dataclasses.dataclass(frozen=True)
class _Tried:
    """A plan made (`step`, with its forward and backward) and estimated under inductor."""

    step: Any  # PlannedStep
    generated: tuple[GraphBytes, ...]
    """Each graph's peak as inductor generates it vs op by op."""

    @property
    def peak(self) -> int:
        """The peak of the model remat solved against (`PlannedStep.planned_peak_bytes`):
        the budget the loop sets is in these bytes."""
        planned = self.step.planned_peak_bytes
        return self.step.evaluation.peak_bytes if planned is None else planned

    @functools.cached_property
    def under_inductor(self) -> int:
        """The step's peak as inductor generates it."""
        return inductor_peak_bytes(self.step.evaluation, self.generated)

    @property
    def margin(self) -> int:
        """What inductor's code adds to `peak` (negative where it holds less)."""
        return self.under_inductor - self.peak

    @property
    def over_op_by_op(self) -> int:
        """What inductor's code adds to the plan run op by op (`PlannedStep.fusion_margin_bytes`)."""
        return self.under_inductor - self.step.evaluation.peak_bytes


FALLBACK_RULES = {"peak": "neighbours"}
"""A rule tried on a plan over the budget where its own rule's code holds more than
remat's model: the compile keeps the rule whose code peaks lower on the plan it runs.
`peak`'s guard bounds fusion by inductor's estimate, which is not the generated code's
peak: ViT tiny's floor plan (its schedule recomputes fc1 once per use of the GELU
backward) holds more beside the copies under `peak` than with neighbour fusion only."""


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How inductor compiles a plan: its fusion rule (`FUSION_MODES`) and, where remat
    sets it, inductor's `layout_optimization` (None: the compile's own setting)."""

    rule: str
    layout_optimization: bool | None = None


def _layout_alternative(joint: fx.GraphModule, inductor_config: dict[str, Any] | None) -> bool:
    """Whether a plan over the budget is also estimated with inductor's layout
    optimization off: the compile has it on and the graph convolves. Inductor then runs
    convolutions channels-last and converts around them, which holds more than the graph
    op by op on some models (ResNet tiny's floor plan: about 270,000 B more in the
    forward) and less on others (cnn tiny: channels-last convolutions need less scratch),
    so it is chosen per plan."""
    from remat.compat import inductor_config as config

    if inductor_config is None or not inductor_config.get("layout_optimization", config.layout_optimization):
        return False
    return any(n.target is torch.ops.aten.convolution.default for n in joint.graph.nodes)


def plan_under_fusion(partitioner: Any, joint: fx.GraphModule, joint_inputs: Any, *, fusion: str,
                      rule: Any = None, inductor_config: dict[str, Any] | None = None,
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Closed loop: plan, ask inductor what its generated code adds over remat's op-by-op
    model (`estimate_fusion`), and if remat's peak plus that margin is over the budget,
    plan again under the budget minus the largest margin seen; when no plan fits that,
    once at remat's floor (its margin may be smaller); where the code holds less, plans
    that use the room (`_use_the_deficit`). The step keeps the user's budget
    and records the margin; a refusal names the floor plan's peak plus its margin. Both
    graphs are estimated together: the backward's saved inputs are held in the storages
    the forward's code returns them in (`estimate.output_storages`). `rule`: the compile's
    fusion pass (`fusion.fusion_passes`), whose mode is set to the rule the plan that runs
    was estimated under (`FALLBACK_RULES`). `inductor_config`: the compile's config patch
    (the dict `compile_fx` applies to the forward's and the lazily compiled backward's
    lowering), where the lowering chosen for the plan that runs sets
    `layout_optimization` (`_layout_alternative`)."""
    # a plan for the whole-step ledger's share of a known step (strict: a budget_for, no
    # best effort) must hold no more between forward and backward than the split counted
    # for it, so it takes no room above its share
    room = partitioner.budget_for is None or partitioner.best_effort
    best_effort, asked = partitioner.best_effort, partitioner.budget
    estimated: dict[tuple[str, str], tuple[GraphBytes, ...]] = {}  # a replan may give the same graphs
    lowered: dict[tuple[str, str], Lowering] = {}  # how each estimate was lowered
    attempted: set[tuple[tuple[str, str], Lowering]] = set()  # alternatives estimated per plan
    known: int | None = None  # the budget in bytes, once known: a plan over it tries the alternatives
    default = Lowering(fusion)
    alternatives = ([Lowering(FALLBACK_RULES[fusion])] if rule is not None and fusion in FALLBACK_RULES else []) + (
        [Lowering(fusion, layout_optimization=False)] if _layout_alternative(joint, inductor_config) else [])

    def estimate(step: Any, lowering: Lowering) -> tuple[GraphBytes, ...]:
        return estimate_fusion(((step.forward, False), (step.backward, True)), fusion=lowering.rule,
                               num_fwd_outputs=kwargs.get("num_fwd_outputs"),
                               workspace=partitioner.measures_workspace,
                               layout_optimization=lowering.layout_optimization)[1]

    def partitioned() -> Any:
        """The partitioner's step at its budget."""
        partitioner(joint, joint_inputs, **kwargs)
        return partitioner.step

    def under_inductor(step: Any, *, every_lowering: bool = False) -> _Tried:
        """`step` estimated under inductor; over a known budget, where the code holds more
        than remat's model (or `every_lowering`: at the floor, where no replan is left),
        also under each alternative lowering, keeping the lowest."""
        key = (step.forward.code, step.backward.code)
        if key not in estimated:  # lowering and codegen: tens of seconds on GPT-2 tiny
            estimated[key], lowered[key] = estimate(step, default), default
        tried = _Tried(step, estimated[key])
        if known is None or tried.under_inductor <= (known if every_lowering else max(known, tried.peak)):
            return tried
        for lowering in alternatives:
            if (key, lowering) in attempted:
                continue
            attempted.add((key, lowering))
            alternative = _Tried(step, estimate(step, lowering))
            if alternative.under_inductor < tried.under_inductor:
                log.info("remat: %s holds less on this plan than %s", lowering, lowered[key])
                estimated[key], lowered[key], tried = alternative.generated, lowering, alternative
        return tried

    def plan() -> _Tried:
        return under_inductor(partitioned())

    no_remat = None  # the plan that saves everything, once estimated
    canonical = None  # (the floor without schedules, its bytes), once estimated
    inlined: dict[str, _Tried] | None = None  # floors planned as inductor's lowering inlines
    if is_percentage(partitioner.budget):
        no_remat = _of_inductors_peak(partitioner, plan)
    try:
        tried = plan()
        budget_bytes, at_floor = tried.step.budget_bytes, False
    except InfeasibleBudgetError as e:  # below remat's floor op by op: the floor's margin decides
        budget_bytes, at_floor = e.budget_bytes, True
        partitioner.budget = _planned_past(e).min_peak_bytes
        log.info("remat: planning at the floor, %d B", e.min_peak_bytes)
        tried = plan()
    known = budget_bytes
    if tried.under_inductor > budget_bytes:  # estimated before the budget was known
        tried = under_inductor(tried.step)
    worst = 0
    least = tried  # the plan tried that peaks lowest under inductor
    for replan in range(MAX_REPLANS + 2):
        log.debug("remat: %s, margin %d B", tried.generated, tried.margin)
        worst = max(worst, tried.margin)
        least = min(least, tried, key=_under_inductor)
        if tried.under_inductor <= budget_bytes:
            break
        if at_floor or replan >= MAX_REPLANS:
            # the floor op by op may peak higher under inductor than a plan tried before
            # it, than the plan at the no-remat peak (ResNet tiny, layout optimization
            # on: 1,327,736 B at the floor, 1,267,576 B at 100%), where it recomputes a
            # value twice, than the floor of plans that recompute each value once (LLaMA
            # tiny: inductor's code holds more beside the copies), or than either floor
            # planned as inductor's lowering inlines pointwise values (LLaMA tiny, each
            # value recomputed once: 2,338,728 B against 2,494,504 B; GPT-2 tiny peaks
            # lower planned op by op), or than the second of those without the floor
            # search's descent (ViT tiny, with schedules: 1,265,636 B, 1,338,532 B
            # descended)
            no_remat = no_remat or _at_no_remat_peak(partitioner, plan)
            if canonical is None and tried.step.plan.schedule is not None:
                canonical = _at_floor(partitioner, plan)
            if inlined is None:
                inlined = _inlined_floors(partitioner, plan)
            others = {"no remat": no_remat, **({"canonical floor": canonical[0]} if canonical else {}),
                      **inlined}
            log.debug("remat: at the floor, under inductor: %s",
                      {name: found.under_inductor for name, found in others.items()})
            fitting = [name for name, found in others.items() if found.under_inductor <= budget_bytes]
            # cheapest first; re-estimating it below only ever lowers it, so it stays the lowest
            lowest = min(others, key=lambda name: others[name].under_inductor)
            if not fitting:
                # inductor's code may hold less than remat's model and still more than the
                # budget, where no replan is left: the lowest plan also tries the other
                # lowerings (ResNet tiny's floor plan: 998,232 B with layout optimization on)
                if least.under_inductor <= others[lowest].under_inductor:
                    least = under_inductor(least.step, every_lowering=True)
                    if least.under_inductor <= budget_bytes:
                        tried = least
                        break
                else:
                    others[lowest] = under_inductor(others[lowest].step, every_lowering=True)
                    fitting = [lowest] if others[lowest].under_inductor <= budget_bytes else []
            pick = (fitting[0] if fitting else
                    lowest if best_effort and others[lowest].under_inductor < least.under_inductor else None)
            if pick is not None:
                tried = others[pick]
                break
            least = min(least, *others.values(), key=_under_inductor)
            if best_effort and not (isinstance(asked, int) and least.under_inductor > asked):
                tried = least  # the ledger's first step: the lowest found runs, unless over the whole budget
                break
            partitioner.error = _refusal(budget_bytes, least.step.evaluation.peak_bytes, least.over_op_by_op)
            raise partitioner.error
        # a margin as large as the budget leaves nothing: the floor decides (below)
        partitioner.budget = max(1, budget_bytes - worst)
        log.info("remat: inductor adds %d B to a plan peaking at %d B; replanning under %d B",
                 tried.margin, tried.peak, partitioner.budget)
        try:
            tried = plan()
        except InfeasibleBudgetError as e:  # below the floor: the floor's own margin decides
            at_floor = True
            partitioner.budget = _planned_past(e).min_peak_bytes
            log.info("remat: replanning at the floor, %d B", e.min_peak_bytes)
            tried = plan()
    if room and tried.margin < 0 and tried.under_inductor <= budget_bytes and not at_floor:
        tried = _use_the_deficit(partitioner, partitioned, under_inductor, budget_bytes, tried)
    chosen = lowered.get((tried.step.forward.code, tried.step.backward.code), default)
    if rule is not None:
        rule.mode = chosen.rule
    settings: tuple[tuple[str, Any], ...] = ()
    if chosen.layout_optimization is not None and inductor_config is not None:
        inductor_config["layout_optimization"] = chosen.layout_optimization
        settings = (("layout_optimization", chosen.layout_optimization),)
    partitioner.step = dataclasses.replace(tried.step, budget_bytes=budget_bytes, inductor_settings=settings,
                                           fusion_margin_bytes=tried.over_op_by_op,
                                           fusion_graph_bytes=tuple(tried.generated),
                                           no_remat_margin_bytes=no_remat.over_op_by_op if no_remat else None)
    return tried.step.forward, tried.step.backward


def _under_inductor(tried: _Tried) -> int:
    return tried.under_inductor


def _planned_past(error: BaseException) -> BaseException:
    """`error`, caught and planned past, without its traceback: its frames run up to the
    compile's caller, which is the frame that goes on to hold the model's outputs, and a
    frame whose locals were read (a snapshot holding `error`) closes a cycle that only
    the garbage collector frees; outputs held so fail `outputs="loss"`'s check."""
    return error.with_traceback(None)


def _of_inductors_peak(partitioner: Any, plan: Callable[[], _Tried]) -> _Tried:
    """A percentage budget made a percentage of inductor's no-remat peak: remat's
    no-remat peak plus what inductor's code adds to the plan that saves everything (or
    less, where it holds less). Returns that plan; the partitioner's budget is then in
    bytes (or, for the ledger's share, its no-remat peak is shifted by the margin)."""
    budget, budget_for, best_effort = partitioner.budget, partitioner.budget_for, partitioner.best_effort
    partitioner.budget = "100%"  # the plan that saves everything (views aside: they are free)
    no_remat = plan()
    if budget_for is None:
        partitioner.budget = resolve_budget(budget, no_remat.under_inductor)
    else:
        margin = no_remat.over_op_by_op  # the ledger's share is of the no-remat peak op by op
        partitioner.budget = budget
        partitioner.budget_for, partitioner.best_effort = (lambda b: budget_for(b + margin)), best_effort
    log.info("remat: %s of inductor's no-remat peak, %d B (remat's %d B %+d B from inductor's kernels)",
             budget, no_remat.under_inductor, no_remat.peak, no_remat.margin)
    return no_remat


def _at_no_remat_peak(partitioner: Any, plan: Callable[[], _Tried]) -> _Tried:
    """The plan at the graph's no-remat peak (of the model remat solves)."""
    partitioner.budget = "100%"
    return plan()


def _inlined_floors(partitioner: Any, plan: Callable[[], _Tried]) -> dict[str, _Tried]:
    """The floors solved as inductor's lowering inlines pointwise values
    (`PlannerSettings.inline_pointwise`): of the plans that recompute each value once, and,
    where the settings allow schedules, of all plans, that one also without the floor
    search's descent (`PlannerSettings.descend_floor`: op by op the descent never raises
    the peak, but inductor's code for the descended plan can hold more). Each is lowest
    on some model (LLaMA tiny: the first; ViT tiny: the third, 1,265,636 B against
    1,338,532 B for the second). Empty where the partitioner already plans so."""
    settings = partitioner.settings
    if settings.inline_pointwise:
        return {}
    out = {"floor as inductor inlines": _at_floor(partitioner, plan, inline_pointwise=True)[0]}
    if settings.schedules:
        out["floor with schedules as inductor inlines"] = _at_floor(
            partitioner, plan, inline_pointwise=True, schedules=True)[0]
        out["floor with schedules as inductor inlines, not descended"] = _at_floor(
            partitioner, plan, inline_pointwise=True, schedules=True, descend_floor=False)[0]
    return out


def _at_floor(partitioner: Any, plan: Callable[[], _Tried], *, inline_pointwise: bool = False,
              schedules: bool = False, descend_floor: bool = True) -> tuple[_Tried, int]:
    """(the plan, its budget) at the floor of the plans that recompute each value at most
    once, or with `schedules` of all plans the settings allow (`_planning_as`), planned
    at that floor's bytes; `inline_pointwise`: solved as inductor's lowering inlines
    pointwise values (`PlannerSettings.inline_pointwise`); `descend_floor`: as
    `PlannerSettings.descend_floor`."""
    with _planning_as(partitioner, inline_pointwise=inline_pointwise, schedules=schedules,
                      descend_floor=descend_floor):
        partitioner.budget = 1
        try:
            floor_bytes = plan().step.budget_bytes  # a graph that holds nothing
        except InfeasibleBudgetError as e:
            floor_bytes = _planned_past(e).min_peak_bytes
        partitioner.budget = floor_bytes
        return plan(), floor_bytes


@contextlib.contextmanager
def _planning_as(partitioner: Any, *, inline_pointwise: bool = False, schedules: bool = False,
                 descend_floor: bool = True) -> Iterator[None]:
    """The partitioner plans without schedules that recompute a value twice (unless
    `schedules`), as inductor inlines and without the floor's descent (each where
    asked), meanwhile."""
    settings = partitioner.settings
    partitioner.settings = dataclasses.replace(settings, schedules=settings.schedules and schedules,
                                               inline_pointwise=settings.inline_pointwise or inline_pointwise,
                                               descend_floor=settings.descend_floor and descend_floor)
    try:
        yield
    finally:
        partitioner.settings = settings


DEFICIT_TRIES = 3
"""Plans tried above the budget when inductor's code holds less than remat's model
(LLaMA bench at torch.compile's 0.5 point: recompute estimated at 18.8 ms with the margin
clamped at 0, 10.3 ms after one try, 5.6 ms after three; each try is a solve and a
lowering of both graphs)."""


def _use_the_deficit(partitioner: Any, partitioned: Callable[[], Any], under_inductor: Callable[[Any], _Tried],
                     budget_bytes: int, fits: _Tried) -> _Tried:
    """The plan `fits` with room: inductor's code holds `-margin` bytes less than remat's
    op-by-op peak. Plan again under the budget plus that room, and keep the plan when it
    costs less and its own prediction fits the budget; then move the target by what the
    last prediction left (up by the room still free, or down by the overshoot: a plan
    that saves more may get less room), `DEFICIT_TRIES` plans in all."""
    best = fits
    lo, hi = budget_bytes, math.inf  # the highest target kept, the lowest that overshot
    target = budget_bytes - fits.margin
    for _ in range(DEFICIT_TRIES):
        partitioner.budget = target
        log.info("remat: inductor's code holds %d B less than remat's model; trying a plan under %d B",
                 -best.margin, target)
        try:
            step = partitioned()
        except InfeasibleBudgetError as e:  # moved down past the floor op by op: `best` stands
            _planned_past(e)
            partitioner.error = None
            break
        if step.evaluation.cost_s >= best.step.evaluation.cost_s:
            break  # saving more buys nothing here
        wider = under_inductor(step)
        predicted = wider.under_inductor
        if predicted <= budget_bytes:
            best, lo = wider, target
        else:
            hi = target
            log.info("remat: that plan would peak at %d B under inductor", predicted)
        target += budget_bytes - predicted
        if not lo < target < hi:  # past a target already tried: halfway between them
            target = (lo + hi) // 2 if hi < math.inf else target
        if predicted == budget_bytes or not lo < target < hi:
            break
    return best


__all__ = ["DEFICIT_TRIES", "FALLBACK_RULES", "MAX_REPLANS", "Lowering", "plan_under_fusion"]
