"""`remat report --fake` on LLaMA-7B's shapes: seconds per stage, total and peak RSS.

    HF_HUB_OFFLINE=1 python bench/fake_7b.py                       # 32 layers, 40GiB, one row
    HF_HUB_OFFLINE=1 python bench/fake_7b.py --layers 4 --profile /tmp/fake.prof

The model (transformers' LlamaConfig: hidden 4096, intermediate 11008, 32 heads, vocab
32000; batch 1 x 2048 tokens) is built on the meta device and planned on fake tensors.
The report runs in a fresh process, as a user runs it; its peak RSS is that process's
(`ru_maxrss` of the child). The stage columns are the CLI's own stages
(`remat.cli.progress.Stages.log`); trace, profile, solve and rewrite split the planning stage
(`Stages.planner_log`, summed over both plans when the budget is refused and the report
is planned again at the floor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

FACTORY = Path(__file__).resolve().parents[1] / "examples" / "llama7b_factory.py"

# Runs the CLI and writes the stages it logged beside the report.
RUN = textwrap.dedent('''
    import json, sys
    import remat.cli.main as cli
    from remat.cli import progress

    made = []
    init = progress.Stages.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    progress.Stages.__init__ = recording
    out, argv = sys.argv[1], sys.argv[2:]
    if out.endswith(".prof"):
        import cProfile
        profiler = cProfile.Profile()
        code = profiler.runcall(cli.main, argv)
        profiler.dump_stats(out)
        out = out[:-5] + ".stages.json"
    else:
        code = cli.main(argv)
    with open(out, "w") as f:
        json.dump([[list(s.log), list(s.planner_log)] for s in made], f)
    sys.exit(code)
''')

STAGES = ("building the model", "tracing", "Pareto sweep", "writing the report")
PLANNING = ("trace", "profile", "solve", "rewrite")


def run(layers: int, budget: str, solver: str, points: int, profile: str | None, warm: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stages_file = profile or str(tmp / "stages.json")
        # cold: dp's block tables are built, not read from an earlier run's disk cache
        cache = {} if warm else {"REMAT_CACHE_DIR": str(tmp / "cache")}
        argv = ["report", f"{FACTORY}:build", "--fake", "--device", "h100", "--budget", budget,
                "--set", f"layers={layers}", "--solver", solver, "--pareto-points", str(points),
                "--out", str(tmp / "report"), "--quiet"]
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", RUN, stages_file, *argv], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **cache,
                                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])})
        total_s = time.perf_counter() - started
        if done.returncode not in (0, 1):
            sys.exit(f"remat report exited {done.returncode}:\n{done.stderr[-3000:]}")
        rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        if profile:
            stages_file = profile[:-5] + ".stages.json"
        ((log, planner_log),) = json.loads(Path(stages_file).read_text())
        report = json.loads((tmp / "report" / "report.json").read_text())
    planning = {stage: sum(s for name, s in planner_log if name == stage) for stage in PLANNING}
    return {"layers": layers, "stages": dict(log), "planning": planning, "total_s": total_s,
            "rss_bytes": rss_bytes, "status": report["status"], "pareto": len(report["pareto"]),
            "predicted_peak_bytes": report["predicted_peak_bytes"], "min_peak_bytes": report["min_peak_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget", default="40GiB")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--pareto-points", type=int, default=8)
    parser.add_argument("--profile", default=None, help="write the report process's cProfile stats here (.prof)")
    parser.add_argument("--warm", action="store_true", help="use the user's disk cache of dp tables (default: "
                        "a fresh one, so the tables are built)")
    parser.add_argument("--json", action="store_true", help="print the row as JSON too")
    opts = parser.parse_args()
    if opts.profile and not opts.profile.endswith(".prof"):
        parser.error("--profile: give a path ending in .prof")
    row = run(opts.layers, opts.budget, opts.solver, opts.pareto_points, opts.profile, opts.warm)
    heads = ["layers", *STAGES, *PLANNING, "total s", "peak RSS GiB", "status", "peak GiB", "floor GiB"]
    cells = [str(row["layers"]), *(f"{row['stages'].get(s, 0.0):.1f}" for s in STAGES),
             *(f"{row['planning'][s]:.1f}" for s in PLANNING), f"{row['total_s']:.1f}",
             f"{row['rss_bytes'] / 2**30:.2f}", row["status"], f"{row['predicted_peak_bytes'] / 2**30:.2f}",
             f"{row['min_peak_bytes'] / 2**30:.2f}"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    print("| " + " | ".join(cells) + " |")
    if opts.json:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
