"""Benchmark remat against what PyTorch users have today, with the same instruments.

Methods, per model (GPT-2 with dropout, LLaMA, BERT, ViT, ResNet-18 with BatchNorm):
  eager       no rematerialization
  checkpoint  ``torch.utils.checkpoint`` (non-reentrant) around every block
  hf-checkpoint  transformers' ``model.gradient_checkpointing_enable()`` (transformers models)
  torch       AOTAutograd + ``min_cut_rematerialization_partition`` under
              ``torch._functorch.config.activation_memory_budget`` in {1.0 ... 0.0}, with
              eager (boxed, free-at-last-use) fw/bw compilers, as remat runs its graphs
  remat:S     ``remat.plan(..., solver=S)`` over budgets from the no-remat peak down to
              the smallest reachable one
  with --compiled (bench/compiled.py; profiler peak, step ratio, compile time):
  torch.compile   inductor with PyTorch's partitioner under activation_memory_budget
  remat+inductor  ``torch.compile(model, backend=remat.backend(...))`` at 100% and at
                  each torch.compile point's measured peak

Per run: measured peak (live-storage tracker; the profiler's allocator view too), extra
FLOPs over eager (FlopCounterMode), median step time interleaved with eager steps,
planning time, and whether gradients and buffers (BatchNorm statistics) equal eager's.
Writes ``results/compare/<model>.{md,json,png}`` and ``summary.md`` with the verdicts.

    HF_HUB_OFFLINE=1 python bench/compare.py            # everything
    HF_HUB_OFFLINE=1 python bench/compare.py --quick    # gpt2, two budgets, < 2 minutes
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._export.utils import _compiling_state_context  # noqa: E402

from remat.frontend.costs import FlopCounter  # noqa: E402
from remat.frontend.trace import compile_joint  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step, measure_step_profiler  # noqa: E402

log = logging.getLogger("bench.compare")

MODELS = ("gpt2", "llama", "bert", "vit", "resnet")
TORCH_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
FIXED_SOLVERS = ("none", "all")  # one point each: their plan ignores the budget
SEED = 1234
MIB = 2**20
COST_MODEL = "compiled"
"""The cost model remat plans with and every method's recomputation is costed with
(`--cost-model`; remat.frontend.costs.COST_MODELS)."""
TIME_LIMIT_S: float | None = None
"""remat's solver time limit (`--time-limit`; None: the solver's default, 10 s for ilp)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One measured configuration."""

    model: str
    method: str
    """eager | checkpoint | torch | remat:<solver>"""
    setting: str
    """The budget as the method takes it ("-" for none)."""
    peak_bytes: int | None = None
    profiler_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    flops: int | None = None
    extra_flops: int | None = None
    step_s: float | None = None
    eager_step_s: float | None = None
    slowdown: float | None = None
    """Median over interleaved pairs of step_s / eager step_s."""
    plan_s: float | None = None
    grads_equal: bool | None = None
    grads_max_abs_diff: float | None = None
    grads_equal_traced_path: bool | None = None
    """Gradients equal those of eager run on the code path transformers takes when traced."""
    buffers_equal: bool | None = None
    recompute_ms: float | None = None
    """Milliseconds the recomputation costs under `COST_MODEL` (torch: its backward's
    copies of forward nodes; remat: its plan's recompute seconds, replays included)."""
    saving_ms: float | None = None
    """Milliseconds of traffic the saved tensors cost: written by the forward and read by
    the backward, 2 x their bytes over the bandwidth (what `remat.planning.fused_recompute` weighs a
    fusible recompute against). recompute + saving is the compiled model's cost."""
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.peak_bytes is not None and self.extra_flops is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """A method ready to run: ``step()`` is one forward+backward on ``case``."""

    case: zoo.ModelCase
    step: Callable[[], Any]
    plan_s: float = 0.0
    predicted_peak_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    """remat's predicted no-remat peak (where its budget sweep starts)."""
    no_remat_peak_bytes: int | None = None
    """Through `remat.backend` with inductor at a percentage: the no-remat peak of the path
    that runs, which the percentage is of (`PlannedStep.no_remat_peak_bytes`: the plan that
    saves everything, as inductor generates it)."""
    recompute_s: float | None = None
    """What the recomputation costs under `COST_MODEL` (see `Row.recompute_ms`)."""
    saving_s: float | None = None
    """See `Row.saving_ms`."""


# --- methods -----------------------------------------------------------------------------


def _loss_step(module: Callable[..., Any], case: zoo.ModelCase) -> Callable[[], None]:
    def step() -> None:
        module(*case.args, **case.kwargs).loss.backward()

    return step


def prepare_eager(case: zoo.ModelCase) -> Prepared:
    return Prepared(case=case, step=_loss_step(case.model, case))


def prepare_checkpoint(case: zoo.ModelCase) -> Prepared:
    """Non-reentrant activation checkpointing around every block's forward."""
    from torch.utils.checkpoint import checkpoint

    for block in case.blocks:
        def forward(*args: Any, _inner=block.forward, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
    return Prepared(case=case, step=_loss_step(case.model, case))


def prepare_hf_checkpoint(case: zoo.ModelCase) -> Prepared:
    """transformers' own switch, the one-liner users call: ``gradient_checkpointing_enable()``
    (in transformers 5 a deprecated alias of ``activation_checkpointing_enable()``, which is
    called when present, so that the row does not warn). Raises for models without it."""
    model = case.model
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise TypeError(f"{type(model).__name__} has no gradient_checkpointing_enable()")
    enable()
    model.train()
    return Prepared(case=case, step=_loss_step(model, case))


class _LossOnly(nn.Module):
    """The model as a function of flat tensors returning ``(loss,)``."""

    def __init__(self, model: nn.Module, kwarg_names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.kwarg_names = kwarg_names

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        n = len(tensors) - len(self.kwarg_names)
        return (self.model(*tensors[:n], **dict(zip(self.kwarg_names, tensors[n:]))).loss,)


def prepare_torch(case: zoo.ModelCase, budget: float) -> Prepared:
    """AOTAutograd with PyTorch's min-cut partitioner at `budget`, compiled eagerly."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    wrapper = _LossOnly(case.model, tuple(case.kwargs))
    inputs = [*case.args, *case.kwargs.values()]
    recompute_s: list[float] = []
    saving_s: list[float] = []

    def partition(joint, *args: Any, **kwargs: Any):
        fw, bw = min_cut_rematerialization_partition(joint, *args, **kwargs)
        recompute_s.append(_torch_recompute_s(fw, bw))
        saving_s.append(_saving_s(fw))
        return fw, bw

    started = time.perf_counter()
    with functorch_config.patch(activation_memory_budget=budget):
        # traced exactly as remat.plan traces (eager code path first), boxed graphs
        compiled = compile_joint(wrapper, inputs, partition, user_model=case.model).compiled
    plan_s = time.perf_counter() - started

    def step() -> None:
        compiled(*inputs)[0].backward()

    return Prepared(case=case, step=step, plan_s=plan_s, recompute_s=sum(recompute_s),
                    saving_s=sum(saving_s))


def _saving_s(fw: torch.fx.GraphModule) -> float:
    """2 x the bytes of the forward module's outputs (the loss and what it saves for the
    backward) over the bandwidth: written once, read once."""
    from remat.frontend import costs

    out = next(n for n in fw.graph.nodes if n.op == "output")
    saved = {a for a in out.args[0] if isinstance(a, torch.fx.Node)}  # each tensor once
    values = [a.meta.get("val") for a in saved]
    saved_bytes = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
    return 2.0 * saved_bytes / costs.device_speed("cpu").bandwidth_bytes_per_s


def _torch_recompute_s(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> float:
    """`COST_MODEL` seconds of the forward nodes torch's backward computes again: the
    min-cut partitioner copies them into the backward under their joint names."""
    from remat.frontend import costs

    forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    again = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in forward]
    cost = costs.cost_function(COST_MODEL, costs.device_speed("cpu"))
    log.info("torch recomputes %d forward nodes: %s", len(again),
             ", ".join(sorted({str(getattr(n.target, "__name__", n.target)) for n in again})))
    return sum(cost(n) for n in again)


def prepare_remat(case: zoo.ModelCase, budget: int | str, solver: str) -> Prepared:
    import remat

    started = time.perf_counter()
    limit = {"time_limit_s": TIME_LIMIT_S} if TIME_LIMIT_S and solver in ("auto", "ilp", "layers") else {}
    # the loss only, as every other row's step keeps (the logits die in the forward)
    planned = remat.plan(case.model, case.args, dict(case.kwargs), budget=budget, solver=solver,
                         cost_model=COST_MODEL, outputs="loss", **limit)
    plan_s = time.perf_counter() - started
    return Prepared(case=case, step=_loss_step(planned, case), plan_s=plan_s,
                    predicted_peak_bytes=planned.predicted_peak_bytes,
                    baseline_peak_bytes=planned.baseline_peak_bytes,
                    recompute_s=planned.step.evaluation.recompute_s, saving_s=_saving_s(planned.step.forward))


def remat_available() -> str | None:
    """None if ``remat.plan`` can be called, else why not."""
    try:
        import remat
    except ImportError as e:
        return f"import remat failed ({e})"
    if not callable(getattr(remat, "plan", None)):
        return "remat has no plan() yet"
    return None


# --- measuring ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reference:
    """Eager's results for one model: what every method is compared with."""

    grads: dict[str, torch.Tensor]
    traced_path_grads: dict[str, torch.Tensor]
    """Eager gradients with `torch.compiler.is_compiling()` set, the code path transformers
    takes when traced (remat.frontend.trace.Traced.library_trace_path):
    what a traced method computes without rematerializing anything."""
    buffers: dict[str, torch.Tensor]
    flops: int
    prepared: Prepared
    init_state: dict[str, torch.Tensor]


def _restore(case: zoo.ModelCase, init_state: dict[str, torch.Tensor]) -> None:
    case.model.load_state_dict(init_state)
    case.model.zero_grad(set_to_none=True)
    gc.collect()


def _register(case: zoo.ModelCase) -> tuple[Any, ...]:
    return (case.model, case.args, case.kwargs)


def _grads(case: zoo.ModelCase) -> dict[str, torch.Tensor]:
    return {k: v.grad.detach().clone() for k, v in case.model.named_parameters() if v.grad is not None}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _memory(p: Prepared, init_state) -> tuple[int, int, dict, dict]:
    _restore(p.case, init_state)
    torch.manual_seed(SEED)
    tracked = measure_step(p.step, register=_register(p.case))
    grads = _grads(p.case)
    buffers = {k: v.detach().clone() for k, v in p.case.model.named_buffers()}
    _restore(p.case, init_state)
    torch.manual_seed(SEED)
    profiled = measure_step_profiler(p.step, register=_register(p.case))
    return tracked.peak_bytes, profiled.peak_bytes, grads, buffers


def _flops(p: Prepared, init_state) -> int:
    _restore(p.case, init_state)
    torch.manual_seed(SEED)
    with FlopCounter() as counter:
        p.step()
    return counter.total_flops


def _timed(p: Prepared) -> float:
    p.case.model.zero_grad(set_to_none=True)
    gc.collect()
    started = time.perf_counter()
    p.step()
    return time.perf_counter() - started


def _interleaved(p: Prepared, eager: Prepared, repeats: int) -> tuple[float, float, float]:
    """Median step time of `p`, of eager, and of their per-pair ratio (drift cancels)."""
    _timed(p), _timed(eager)  # warm up
    pairs = [(_timed(eager), _timed(p)) for _ in range(repeats)]
    return (statistics.median(b for _, b in pairs), statistics.median(a for a, _ in pairs),
            statistics.median(b / a for a, b in pairs))


def reference(case: zoo.ModelCase) -> Reference:
    init_state = copy.deepcopy(case.model.state_dict())
    prepared = prepare_eager(case)
    _, _, grads, buffers = _memory(prepared, init_state)
    _restore(case, init_state)
    torch.manual_seed(SEED)
    with _compiling_state_context():
        prepared.step()
    traced_path_grads = _grads(case)
    return Reference(grads=grads, traced_path_grads=traced_path_grads, buffers=buffers,
                     flops=_flops(prepared, init_state), prepared=prepared, init_state=init_state)


def measure(p: Prepared, ref: Reference, *, model: str, method: str, setting: str, repeats: int) -> Row:
    init_state = ref.init_state
    peak, profiler_peak, grads, buffers = _memory(p, init_state)
    diffs = [(grads[k] - g).abs().max().item() for k, g in ref.grads.items() if k in grads]
    flops = _flops(p, init_state)
    step_s, eager_s, slowdown = _interleaved(p, ref.prepared, repeats)
    return Row(
        model=model, method=method, setting=setting, peak_bytes=peak, profiler_peak_bytes=profiler_peak,
        predicted_peak_bytes=p.predicted_peak_bytes, flops=flops, extra_flops=flops - ref.flops,
        step_s=step_s, eager_step_s=eager_s, slowdown=slowdown, plan_s=p.plan_s,
        grads_equal=_equal(grads, ref.grads), grads_equal_traced_path=_equal(grads, ref.traced_path_grads),
        grads_max_abs_diff=max(diffs, default=0.0) if grads.keys() == ref.grads.keys() else float("inf"),
        buffers_equal=all(torch.equal(buffers[k], b) for k, b in ref.buffers.items()),
        recompute_ms=None if p.recompute_s is None else 1e3 * p.recompute_s,
        saving_ms=None if p.saving_s is None else 1e3 * p.saving_s,
    )


def _failed(model: str, method: str, setting: str, error: BaseException) -> Row:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    log.warning("%s %s %s failed: %s: %s", model, method, setting, type(error).__name__, first)
    return Row(model=model, method=method, setting=setting, note=f"{type(error).__name__}: {first[:160]}")


# --- sweeps ------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _linspace_bytes(high: int, low: int, points: int) -> list[int]:
    """`points` budgets from `high` down to `low`, evenly spaced, descending."""
    if points <= 1 or high <= low:
        return [high]
    return sorted({round(high - (high - low) * i / (points - 1)) for i in range(points)}, reverse=True)


def torch_rows(name: str, size: str, ref: Reference, budgets, repeats: int) -> list[Row]:
    rows = []
    for budget in budgets:
        setting = f"budget={budget:g}"
        try:
            prepared = prepare_torch(zoo.build(name, size=size), budget)
            rows.append(measure(prepared, ref, model=name, method="torch", setting=setting, repeats=repeats))
        except Exception as e:  # noqa: BLE001 - a benchmark reports failures and goes on
            rows.append(_failed(name, "torch", setting, e))
        log.info("%s", _row_line(rows[-1]))
    return rows


def remat_rows(name: str, size: str, ref: Reference, solvers, points: int, repeats: int,
               targets: tuple[int, ...] = ()) -> list[Row]:
    """remat per solver over `points` budgets from the no-remat peak down to the
    smallest reachable, plus each of `targets` (the measured peaks of the other methods:
    the dominance question is what remat costs at exactly their memory). remat plans the
    loss as the only output (`outputs="loss"`): every other method's step drops the
    logits before backward too, so a budget equal to their measured peak compares like
    with like (holding the logits for a caller would cost remat 4 MiB of GPT-2 bench)."""
    why = remat_available()
    if why is not None:
        log.warning("skipping remat rows: %s", why)
        return [Row(model=name, method="remat", setting="-", note=f"skipped: {why}")]
    import remat

    rows = []
    for solver in solvers:
        method = f"remat:{solver}"
        case = zoo.build(name, size=size)
        try:
            top = prepare_remat(case, "100%", solver)
        except Exception as e:  # noqa: BLE001
            rows.append(_failed(name, method, "100%", e))
            continue
        budgets: list[Any] = [None]  # None: the plan at 100% already made
        baseline, low = top.baseline_peak_bytes, 1
        if solver not in FIXED_SOLVERS and points > 1:
            try:
                prepare_remat(case, 1, solver)
                low = 1
            except remat.InfeasibleBudgetError as e:
                low = e.min_peak_bytes
            except Exception as e:  # noqa: BLE001
                rows.append(_failed(name, method, "smallest", e))
                low = baseline
            budgets += _linspace_bytes(baseline, low, points)[1:]
        if solver not in FIXED_SOLVERS:  # --points 1: 100% and the other methods' peaks only
            budgets += sorted((t for t in set(targets) if low <= t < baseline and t not in budgets),
                              reverse=True)
        for budget in budgets:
            setting = "100%" if budget is None else f"{budget / MIB:.2f} MiB"
            try:
                prepared = top if budget is None else prepare_remat(case, budget, solver)
                rows.append(measure(prepared, ref, model=name, method=method, setting=setting, repeats=repeats))
            except remat.InfeasibleBudgetError as e:
                rows.append(Row(model=name, method=method, setting=setting,
                                note=f"infeasible for {solver}; smallest reachable {_mib(e.min_peak_bytes)} MiB"))
            except Exception as e:  # noqa: BLE001
                rows.append(_failed(name, method, setting, e))
            log.info("%s", _row_line(rows[-1]))
    return rows


def run_model(name: str, opts: argparse.Namespace) -> list[Row]:
    log.info("== %s (%s)", name, opts.size)
    eager_case = zoo.build(name, size=opts.size)
    ref = reference(eager_case)
    rows = [measure(ref.prepared, ref, model=name, method="eager", setting="-", repeats=opts.repeats)]
    log.info("%s", _row_line(rows[-1]))
    try:
        prepared = prepare_checkpoint(zoo.build(name, size=opts.size))
        rows.append(measure(prepared, ref, model=name, method="checkpoint", setting="every block",
                            repeats=opts.repeats))
    except Exception as e:  # noqa: BLE001
        rows.append(_failed(name, "checkpoint", "every block", e))
    log.info("%s", _row_line(rows[-1]))
    rows += _hf_rows(name, opts, ref)
    rows += torch_rows(name, opts.size, ref, opts.torch_budgets, opts.repeats)
    targets = tuple(r.peak_bytes for r in rows if r.method in ("torch", "checkpoint", "hf-checkpoint")
                    and r.measured)
    rows += remat_rows(name, opts.size, ref, opts.solvers, opts.points, opts.repeats, targets)
    if opts.compiled:
        rows += _compiled_rows(name, opts, ref)
    return rows


def _hf_rows(name: str, opts: argparse.Namespace, ref: Reference) -> list[Row]:
    """The gradient_checkpointing_enable() row, for the transformers models."""
    case = zoo.build(name, size=opts.size)
    if not getattr(case.model, "supports_gradient_checkpointing", False):
        return []
    try:
        row = measure(prepare_hf_checkpoint(case), ref, model=name, method="hf-checkpoint",
                      setting="gradient_checkpointing_enable()", repeats=opts.repeats)
    except Exception as e:  # noqa: BLE001
        row = _failed(name, "hf-checkpoint", "gradient_checkpointing_enable()", e)
    log.info("%s", _row_line(row))
    return [row]


def _compiled_rows(name: str, opts: argparse.Namespace, ref: Reference) -> list[Row]:
    """bench/compiled.py's rows (it imports this module as `compare`)."""
    import importlib.util

    sys.modules.setdefault("compare", sys.modules[__name__])
    spec = importlib.util.spec_from_file_location("bench_compiled", Path(__file__).with_name("compiled.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compiled_rows(name, opts.size, ref, module.TORCH_COMPILE_BUDGETS, opts.repeats)


# --- verdicts ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    model: str
    claim: str
    holds: bool | None
    """None: could not be checked (rows missing)."""
    detail: str


def _point(r: Row) -> str:
    return f"{r.method} {r.setting}: {_mib(r.peak_bytes)} MiB, +{r.extra_flops / 1e9:.3f} GFLOP"


def verdicts(rows: list[Row]) -> list[Verdict]:
    """Check the claims on measured rows: every torch budget point is dominated by a remat
    point; remat's lowest peak is below torch's budget 0.0 and below per-block
    checkpointing; and whether torch's peak is monotone in its budget."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model and r.measured]
        remat_pts = [r for r in mine if r.method.startswith("remat")]
        torch_pts = sorted((r for r in mine if r.method == "torch"), key=lambda r: -float(r.setting.split("=")[1]))
        ckpt = next((r for r in mine if r.method == "checkpoint"), None)
        hf = next((r for r in mine if r.method == "hf-checkpoint"), None)
        if not remat_pts:
            out.append(Verdict(model=model, claim="remat measured", holds=None, detail="no remat rows measured"))
        for t in torch_pts if remat_pts else ():
            better = [r for r in remat_pts if r.peak_bytes <= t.peak_bytes and r.extra_flops <= t.extra_flops]
            if better:
                best = min(better, key=lambda r: (r.extra_flops, r.peak_bytes))
                detail = f"{_point(t)}  <=  {_point(best)}"
            else:
                under = [r for r in remat_pts if r.peak_bytes <= t.peak_bytes]
                detail = f"NOT dominated: {_point(t)}; " + (
                    f"cheapest remat at <= its peak: {_point(min(under, key=lambda r: r.extra_flops))}"
                    if under else "no remat point reaches its peak")
            out.append(Verdict(model=model, claim=f"torch {t.setting} dominated", holds=bool(better), detail=detail))
        if remat_pts:
            low = min(remat_pts, key=lambda r: r.peak_bytes)
            zero = next((t for t in torch_pts if float(t.setting.split("=")[1]) == 0.0), None)
            for label, other in (("torch budget=0", zero), ("checkpoint", ckpt),
                                 ("gradient_checkpointing_enable()", hf)):
                if other is None and label.startswith("gradient") and not any(
                        r.model == model and r.method == "hf-checkpoint" for r in rows):
                    continue  # not a transformers model: no such switch
                if other is None:
                    out.append(Verdict(model=model, claim=f"remat peak < {label}", holds=None, detail="not measured"))
                else:
                    at_most = label.startswith("gradient")  # the claim: at or below the one-liner
                    out.append(Verdict(model=model, claim=f"remat peak {'<=' if at_most else '<'} {label}",
                                       holds=low.peak_bytes <= other.peak_bytes if at_most
                                       else low.peak_bytes < other.peak_bytes,
                                       detail=f"{_point(low)}  vs  {_point(other)}"))
        failed = [r for r in rows if r.model == model and not r.measured and r.note
                  and not r.note.startswith(("infeasible", "skipped"))]
        for method in dict.fromkeys(r.method for r in failed):
            bad = [r for r in failed if r.method == method]
            out.append(Verdict(model=model, claim=f"{method} runs", holds=False,
                               detail=f"failed at {', '.join(r.setting for r in bad)}: {bad[0].note}"))
        rises = [(a, b) for a, b in zip(torch_pts, torch_pts[1:]) if b.peak_bytes > a.peak_bytes]
        if torch_pts:
            detail = "; ".join(f"{a.setting} {_mib(a.peak_bytes)} MiB -> {b.setting} {_mib(b.peak_bytes)} MiB"
                               for a, b in rises) or "peaks: " + ", ".join(
                f"{t.setting} {_mib(t.peak_bytes)}" for t in torch_pts)
            out.append(Verdict(model=model, claim="torch peak monotone in budget", holds=not rises, detail=detail))
    return out


# --- output ------------------------------------------------------------------------------


_COLUMNS = ("method", "setting", "peak MiB", "profiler MiB", "predicted MiB", "extra GFLOP", "extra %",
            "step s", "eager s", "slowdown", "plan s", "grads == eager", "buffers == eager",
            "recompute ms (cost model)", "saving ms", "note")


def _fmt(x: Any, spec: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec)


def _cells(r: Row, eager_flops: int | None) -> list[str]:
    pct = None if r.extra_flops is None or not eager_flops else 100.0 * r.extra_flops / eager_flops
    grads = _fmt(r.grads_equal)
    if r.grads_equal is False and r.grads_max_abs_diff is not None:
        grads += f" ({r.grads_max_abs_diff:.1e})"
        if r.grads_equal_traced_path:
            grads += "; = traced-path eager"
    return [r.method, r.setting, _mib(r.peak_bytes), _mib(r.profiler_peak_bytes), _mib(r.predicted_peak_bytes),
            _fmt(None if r.extra_flops is None else r.extra_flops / 1e9, ".3f"), _fmt(pct, ".1f"),
            _fmt(r.step_s, ".3f"), _fmt(r.eager_step_s, ".3f"), _fmt(r.slowdown, ".2f"), _fmt(r.plan_s, ".1f"),
            grads, _fmt(r.buffers_equal), _fmt(r.recompute_ms, ".3f"), _fmt(r.saving_ms, ".3f"), r.note.replace("|", "/")]


def _row_line(r: Row) -> str:
    """A progress line: method, setting, peak, profiler peak, extra GFLOP, slowdown, note."""
    c = _cells(r, None)
    return " | ".join([r.model, *c[:4], c[5], c[9], c[13], c[14], r.note])


def markdown(rows: list[Row]) -> str:
    eager = next((r for r in rows if r.method == "eager" and r.flops), None)
    eager_flops = eager.flops if eager else None
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r, eager_flops)) + " |" for r in rows]
    return "\n".join(lines)


def verdict_table(vs: list[Verdict]) -> str:
    lines = ["| model | claim | holds | numbers |", "|---|---|---|---|"]
    lines += [f"| {v.model} | {v.claim} | {_fmt(v.holds) if v.holds is not None else 'unchecked'} | "
              f"{v.detail.replace('|', '/')} |" for v in vs]
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eager = next((r for r in rows if r.method == "eager" and r.measured), None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r.method for r in rows):
        pts = [r for r in rows if r.method == method and r.measured]  # in budget order
        if not pts:
            continue
        xs = [100.0 * r.extra_flops / eager.flops if eager else r.extra_flops / 1e9 for r in pts]
        ys = [r.peak_bytes / MIB for r in pts]
        style = "o-" if len(pts) > 1 else "s"
        ax.plot(xs, ys, style, label=method, alpha=0.85)
        if method == "torch":
            for x, y, r in zip(xs, ys, pts):
                ax.annotate(r.setting.split("=")[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("extra FLOPs over eager (% of eager)" if eager else "extra GFLOP")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title(f"{rows[0].model}: peak vs recomputation (lower-left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[Row], out: Path, opts: argparse.Namespace) -> str:
    out.mkdir(parents=True, exist_ok=True)
    summary = [f"# remat vs PyTorch — size `{opts.size}`, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads, {opts.repeats} timing pairs\n"]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        (out / f"{model}.json").write_text(json.dumps([dataclasses.asdict(r) for r in mine], indent=1))
        table = markdown(mine)
        (out / f"{model}.md").write_text(f"# {model}\n\n{table}\n\n![{model}]({model}.png)\n")
        if any(r.measured for r in mine):
            plot(mine, out / f"{model}.png")
        summary.append(f"## {model}\n\n{table}\n")
    summary.append("## Verdicts\n\n" + verdict_table(verdicts(rows)) + "\n")
    text = "\n".join(summary)
    (out / "summary.md").write_text(text)
    return text


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument("--size", default="bench", help="zoo size (tiny for a smoke run)")
    parser.add_argument("--solvers", default=None, help="comma-separated remat solvers (default: all but brute)")
    parser.add_argument("--torch-budgets", default=",".join(map(str, TORCH_BUDGETS)))
    parser.add_argument("--points", type=int, default=6, help="remat budgets per solver")
    parser.add_argument("--repeats", type=int, default=5, help="timed (eager, method) pairs per run, >= 5")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps step times steady on a shared 2-core machine, where "
                             "OpenMP barriers under oversubscription made eager steps vary 20x (0 = torch's default)")
    parser.add_argument("--out", default="results/compare")
    parser.add_argument("--quick", action="store_true", help="gpt2, two budgets, one solver")
    parser.add_argument("--cost-model", default=COST_MODEL,
                        help="how remat prices a recompute, and every method's recompute column "
                             "(remat.frontend.costs.COST_MODELS: compiled, compiled-traffic, eager)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="remat's solver time limit in deterministic seconds (auto, ilp, layers; "
                             "default: the solver's own, 10 s)")
    parser.add_argument("--compiled", action="store_true",
                        help="add torch.compile and remat+inductor rows (bench/compiled.py)")
    opts = parser.parse_args(argv)
    opts.models = tuple(m for m in opts.models.split(",") if m)
    opts.torch_budgets = tuple(float(b) for b in opts.torch_budgets.split(","))
    opts.solvers = tuple(opts.solvers.split(",")) if opts.solvers else _default_solvers()
    if opts.quick:
        opts.models, opts.torch_budgets, opts.points = ("gpt2",), (1.0, 0.0), 2
        opts.solvers = tuple(s for s in opts.solvers if s not in FIXED_SOLVERS)[:1]
    return opts


def _default_solvers() -> tuple[str, ...]:
    try:
        from remat_solvers import SOLVERS
    except ImportError:
        return ("auto",)
    names = [s for s in SOLVERS if s != "brute"]
    return tuple(sorted(names, key=lambda s: (s in FIXED_SOLVERS, s != "auto", s)))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    opts = _parse(argv)
    global COST_MODEL, TIME_LIMIT_S
    COST_MODEL, TIME_LIMIT_S = opts.cost_model, opts.time_limit
    if opts.threads:
        torch.set_num_threads(opts.threads)
    started = time.perf_counter()
    rows: list[Row] = []
    for name in opts.models:
        rows += run_model(name, opts)
        write_results(rows, Path(opts.out), opts)  # partial results survive an interrupted run
    text = write_results(rows, Path(opts.out), opts)
    print(text)
    print(f"\nwrote {opts.out}/ in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
