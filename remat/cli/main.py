"""The command line: `remat report | fit | plan` (also `python -m remat`).

    remat report path/to/model.py:build --budget 6GiB --out report/ [--set batch_size=8]
    remat fit package.module:build --budget 6GiB --vary batch_size [--max 256]
    remat plan --model gpt2 --size tiny --budget 70%      (a bundled model)

Exit codes: 0 done; 1 the answer is "no": `report`'s budget is below the smallest
reachable peak (the report is written all the same, for the plan at that floor, status
"infeasible"), or `fit` found no value that fits; 2 a mistake in the command (bad
TARGET, factory, --set, budget, option).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import remat
from remat import partitioner
from remat.budget import format_bytes
from remat.cli import fit
from remat.cli import target as tgt
from remat.cli.progress import Stages
from remat.errors import RematError
from remat.frontend import devices
from remat.frontend.fake import build_fake, to_fake
from remat.report import html, plots, text, to_json
from remat.report.breakdown import TrainingOptions
from remat.report.data import below_the_floor, build_report

FAKE_DEFAULT_DEVICE = "h100"
_OFFLOAD = {"auto": "auto", "on": True, "off": False}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    opts = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING)
    try:
        return {"plan": _cmd_plan, "report": _cmd_report, "fit": _cmd_fit}[opts.command](opts)
    except RematError as e:
        print(f"remat: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description="activation rematerialization planner")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a bundled model (remat.testing.zoo) and print the summary")
    p.add_argument("--model", default="gpt2", help="one of remat.testing.zoo.NAMES")
    p.add_argument("--size", default="tiny", help="tiny, bench, small (gpt2) or micro")
    p.add_argument("--budget", default="70%", help="bytes, '800MB', '1.5GiB' or '70%%'")
    p.add_argument("--solver", default="auto")
    p.add_argument("-v", "--verbose", action="store_true")

    r = sub.add_parser("report", help="plan your model under a budget; write report.json, report.html, PNGs")
    _target_args(r)
    r.add_argument("--out", default="remat-report", help="directory for the report files")
    r.add_argument("--optimizer", default="adamw", choices=("sgd", "sgd-momentum", "adam", "adamw"))
    r.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "fp16-mixed"))
    r.add_argument("--shard", type=int, default=1, help="devices the model state is sharded over")
    r.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                   help="what --shard divides: 1 optimizer, 2 + gradients, 3 + weights (FSDP)")
    r.add_argument("--adapter", default="none", choices=("none", "lora", "qlora"),
                   help="frozen base weights: lora at weight precision, qlora in 4 bits")
    r.add_argument("--pareto-points", type=int, default=8, help="budgets in the Pareto sweep (>= 2)")
    r.add_argument("--pareto-time-limit", type=float, default=5.0, help="seconds per sweep point")

    f = sub.add_parser("fit", help="the largest batch_size / seq_len whose plan fits the budget")
    _target_args(f)
    f.add_argument("--vary", required=True, help="the factory argument to search, e.g. batch_size or seq_len")
    f.add_argument("--start", type=int, default=1, help="first value tried")
    f.add_argument("--max", type=int, default=None, help="largest value tried")
    f.add_argument("--out", default="fit.json", help="JSON file with every probe")
    return parser


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or package.module:factory; "
                   "the factory returns (model, args) or (model, args, kwargs)")
    p.add_argument("--budget", required=True, help="bytes, '800MB', '1.5GiB' or '70%%' of the no-remat peak")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="keyword argument for the factory (repeatable)")
    p.add_argument("--solver", default="auto")
    p.add_argument("--fake", action="store_true",
                   help="build and plan on fake tensors: nothing allocated, costs from --device")
    p.add_argument("--device", default=None,
                   help="cost model of a named device (h100, h200, a100, l4); default: measure this "
                        f"machine, or {FAKE_DEFAULT_DEVICE} with --fake")
    p.add_argument("--offload", default="auto", choices=("auto", "on", "off"),
                   help="let the planner move activations to host memory (auto: on CUDA only)")
    p.add_argument("--outputs", default="all", choices=("all", "loss"),
                   help="what the training loop keeps of the model's outputs through backward: all "
                        "(default) or the loss only (logits die in the forward, as in "
                        "`model(**batch).loss.backward()` or transformers' Trainer)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.add_argument("-v", "--verbose", action="store_true")


def _cmd_plan(opts: argparse.Namespace) -> int:
    # the test models, for `remat plan --model` only: the rest of the CLI does not depend
    # on remat.testing (tests' and benches' tools)
    from remat.testing import zoo

    if opts.model not in zoo.NAMES:
        raise RematError(f"--model {opts.model!r} is not one of {list(zoo.NAMES)}")
    case = zoo.build(opts.model, size=opts.size)
    planned = remat.plan(case.model, case.args, case.kwargs, budget=opts.budget, solver=opts.solver)
    print(planned.summary())
    return 0


def _build(opts: argparse.Namespace, sets: dict[str, Any]):
    """(Built, device_speed, cost model text) for TARGET with `sets`."""
    factory = tgt.load_factory(opts.target)
    if opts.fake:
        built, mode = build_fake(lambda: _call(factory, opts.target, sets))
        model, args, kwargs = to_fake((built.model, built.args, built.kwargs), mode)
        built = tgt.Built(model=model, args=args, kwargs=kwargs)
    else:
        built = _call(factory, opts.target, sets)
    name = opts.device or (FAKE_DEFAULT_DEVICE if opts.fake else None)
    if name is None:
        return built, None, "roofline of this machine (measured microbenchmark)"
    try:
        device = devices.named_device(name)
    except ValueError as e:
        raise tgt.TargetError(f"--device: {e}") from None
    dtype = devices.model_dtype(built.model)
    return built, device.speed(dtype), f"roofline of {device.name} at {dtype} peak ({device.source})"


def _call(factory, target: str, sets: dict[str, Any]):
    try:
        return tgt.call_factory(factory, target, sets)
    except RematError:
        raise
    except Exception as e:  # the user's own code failed: say where, keep it one line
        raise tgt.TargetError(f"TARGET {target!r} raised {type(e).__name__}: {e}") from e


def _cmd_report(opts: argparse.Namespace) -> int:
    try:
        training = TrainingOptions(optimizer=opts.optimizer, precision=opts.precision, shard=opts.shard,
                                   zero_stage=opts.zero_stage, adapter=opts.adapter)
    except ValueError as e:
        raise tgt.TargetError(f"bad training option (--shard, --zero-stage, ...): {e}") from None
    if opts.pareto_points < 2:
        raise tgt.TargetError(f"--pareto-points {opts.pareto_points}: give at least 2")
    stages = Stages(quiet=opts.quiet)
    with stages.stage("building the model"):
        built, speed, cost_model = _build(opts, tgt.parse_sets(opts.set))
    with stages.planning(opts.verbose):
        partitioner.log.debug("remat: tracing the training step", extra={partitioner.STAGE: "trace"})
        # "no" is an answer: below the floor, the floor's plan from the same trace, reported
        planned = remat.plan(built.model, built.args, built.kwargs, budget=opts.budget, solver=opts.solver,
                             device_speed=speed, offload=_OFFLOAD[opts.offload], outputs=opts.outputs,
                             floor_if_refused=True)
    refused = planned.step.refusal
    with stages.stage("Pareto sweep") as advance:
        report = build_report(planned.step, built.model, name=opts.target, options=training,
                              pareto_points=opts.pareto_points, pareto_time_limit_s=opts.pareto_time_limit,
                              cost_model=cost_model, fake=opts.fake, on_pareto_point=advance,
                              solver=opts.solver)
    if refused is not None:
        report = below_the_floor(report, refused.budget_bytes)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with stages.stage("writing the report"):
        written = [to_json.write_json(report, out / "report.json"), html.write_html(report, out / "report.html"),
                   plots.save_png(plots.timeline_figure(report), out / "timeline.png"),
                   plots.save_png(plots.pareto_figure(report), out / "pareto.png")]
    print(text.render(report))
    print("wrote " + ", ".join(str(p) for p in written))
    if refused is not None:
        print(f"remat: {_one_line(refused)}", file=sys.stderr)
        return 1
    return 0


def _cmd_fit(opts: argparse.Namespace) -> int:
    if "%" in opts.budget:
        raise tgt.TargetError(f"--budget {opts.budget!r}: fit needs an absolute budget (e.g. 6GiB); "
                              "a percentage of the no-remat peak changes with the value searched")
    remat.resolve_budget(opts.budget, 1)  # a malformed budget fails before any build
    sets = tgt.parse_sets(opts.set)
    if opts.vary in sets:
        raise tgt.TargetError(f"--vary {opts.vary} is also given with --set; drop one of them")
    stages = Stages(quiet=opts.quiet)

    def plan_value(v: int, budget: int | str = opts.budget) -> int:
        built, speed, _ = _build(opts, {**sets, opts.vary: v})
        planned = remat.plan(built.model, built.args, built.kwargs, budget=budget,
                             solver=opts.solver, device_speed=speed, offload=_OFFLOAD[opts.offload],
                             outputs=opts.outputs)
        return planned.predicted_peak_bytes

    def floor_of(v: int) -> int:
        """The smallest reachable peak at value v (the refusal of a 1-byte budget)."""
        try:
            return plan_value(v, 1)
        except remat.InfeasibleBudgetError as e:
            return e.min_peak_bytes

    with stages.stage(f"searching {opts.vary}"):
        result = fit.search(fit.timed_probe(plan_value, remat.InfeasibleBudgetError),
                            start=opts.start, maximum=opts.max)
    Path(opts.out).write_text(json.dumps({
        "target": opts.target, "vary": opts.vary, "budget": opts.budget, "set": sets,
        "answer": result.answer, "hit_maximum": result.hit_maximum,
        "probes": [dataclasses.asdict(p) for p in result.probes],
    }, indent=1) + "\n", encoding="utf-8")
    by_value = {p.value: p for p in result.probes}
    if result.answer is None:
        first = by_value[opts.start]
        print(f"no {opts.vary} >= {opts.start} fits {opts.budget}: {opts.vary}={opts.start} needs at least "
              f"{format_bytes(first.min_peak_bytes)} (its floor); probes in {opts.out}")
        return 1
    more = " (the --max given; larger values were not tried)" if result.hit_maximum else ""
    fits = by_value[result.answer]
    print(f"{opts.vary}={result.answer} fits {opts.budget}{more}: predicted peak "
          f"{format_bytes(fits.predicted_peak_bytes)}, floor {format_bytes(floor_of(result.answer))}")
    if not result.hit_maximum:
        nearest = by_value[result.answer + 1]
        print(f"{opts.vary}={result.answer + 1} does not: its floor is {format_bytes(nearest.min_peak_bytes)}")
    print(f"probes in {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
