"""`remat report` and `remat fit` on a user's own model file (not a bundled model): the
files it writes, report.json equal to `remat.plan`, the Pareto sweep, the breakdown
summing to the peak, fit's boundary, and one-line errors with exit code 2."""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import remat
import remat.cli.main as cli
from remat.budget import format_bytes
from remat.cli import target
from remat.report.breakdown import activations_at_peak

USER_FILE = textwrap.dedent('''
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


    class Net(nn.Module):
        def __init__(self, width, depth):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
            self.head = nn.Linear(width, 10)

        def forward(self, x, y):
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x), y)


    def build(batch_size=64, width=32, depth=3):
        torch.manual_seed(0)
        x = torch.randn(batch_size, width)
        return Net(width, depth), (x,), {"y": torch.randint(0, 10, (batch_size,))}


    def wrong():
        return Net(8, 1)


    NOT_A_FUNCTION = 3
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "mymodel.py"
    path.write_text(USER_FILE)
    return path


@pytest.fixture(scope="module")
def report_dir(user_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    argv = ["report", f"{user_file}:build", "--budget", "80%", "--out", str(out), "--set", "batch_size=128",
            "--optimizer", "adam", "--precision", "bf16-mixed", "--quiet"]
    assert cli.main(argv) == 0
    return out


def _plan_like_the_cli(user_file: Path, budget, **sets):
    built = target.call_factory(target.load_factory(f"{user_file}:build"), "build", sets)
    return built, remat.plan(built.model, built.args, built.kwargs, budget=budget)


def test_report_writes_every_file(report_dir):
    for name in ("report.json", "report.html", "timeline.png", "pareto.png"):
        assert (report_dir / name).stat().st_size > 1000, name
    for name in ("timeline.png", "pareto.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report_dir / "report.html").read_text()
    # self-contained: nothing to fetch, nothing to run
    for needle in ("<script", "<link", "<img", "src=", 'href="http', "<metadata", "@import"):
        assert needle not in page, needle
    assert not re.search(r"url\((?!#)", page)  # only in-page references (SVG clip paths)
    assert page.count("<svg") == 2 and "Decisions per layer" in page and "blocks.0" in page


def test_report_json_equals_the_api(report_dir, user_file):
    data = json.loads((report_dir / "report.json").read_text())
    _, planned = _plan_like_the_cli(user_file, "80%", batch_size=128)
    step = planned.step
    assert data["schema_version"] == 1
    assert data["budget_bytes"] == planned.budget_bytes
    assert data["baseline_peak_bytes"] == planned.baseline_peak_bytes
    assert data["predicted_peak_bytes"] == planned.predicted_peak_bytes <= planned.budget_bytes
    assert data["extra_compute_s"] == step.evaluation.recompute_s
    assert data["status"] == planned.plan.status.value and data["solver"] == planned.plan.solver
    names = step.graph_problem.value_name
    api = {names[i]: d.value for i, d in planned.plan.decisions.items()}
    assert {row["name"]: row["decision"] for row in data["decisions"]} == api
    assert [p["live_bytes"] for p in data["timeline"]] == list(step.evaluation.timeline)
    assert max(p["live_bytes"] for p in data["timeline"]) == data["predicted_peak_bytes"]
    # every decision row says where it came from: a module path and a file:line
    assert all(re.fullmatch(r".+\.py:\d+", r["source"]) for r in data["decisions"])
    block_rows = [r for r in data["decisions"] if r["module_class"] == "Block"]
    assert len({r["module"] for r in block_rows}) == 3  # blocks.0, blocks.1, blocks.2
    assert all(r["source"] == f"{user_file}:12" for r in block_rows)  # Block.forward


def test_pareto_is_monotone_from_the_no_remat_peak_down_to_the_floor(report_dir):
    data = json.loads((report_dir / "report.json").read_text())
    pareto = data["pareto"]
    assert len(pareto) >= 5
    budgets = [p["budget_bytes"] for p in pareto]
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
    assert budgets[0] == data["min_peak_bytes"] and budgets[-1] == data["baseline_peak_bytes"]
    assert pareto[-1]["extra_compute_s"] == 0.0
    for a, b in zip(pareto, pareto[1:]):
        assert b["extra_time_s"] <= a["extra_time_s"]
    for p in pareto:  # no offload on CPU by default: extra time is recompute time
        assert p["offload_s"] == 0.0 and p["extra_time_s"] == p["extra_compute_s"]
    for p in pareto:
        assert p["predicted_peak_bytes"] <= p["budget_bytes"]
    assert data["min_peak_bytes"] <= data["predicted_peak_bytes"]
    # the reported plan is on or above the front: no point that affords it costs more
    for p in pareto:
        if p["budget_bytes"] >= data["predicted_peak_bytes"]:
            assert p["extra_time_s"] <= data["extra_compute_s"] + data["offload_s"]


def test_breakdown_counts_state_by_formula_and_activations_sum_to_the_peak(report_dir, user_file):
    data = json.loads((report_dir / "report.json").read_text())
    b = data["breakdown"]
    built, planned = _plan_like_the_cli(user_file, "80%", batch_size=128)
    psi = sum(p.numel() for p in built.model.parameters())
    assert b["trainable_params"] == psi and b["frozen_params"] == 0
    # ZeRO's mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter
    assert (b["weights_bytes"], b["gradients_bytes"], b["master_bytes"], b["optimizer_bytes"]) == (
        2 * psi, 2 * psi, 4 * psi, 8 * psi)
    assert b["model_state_bytes"] == 16 * psi
    step = planned.step
    live = activations_at_peak(step.graph_problem.problem, step.plan.decisions, step.evaluation)
    assert sum(v for k, v in live.items() if k != "offloaded") == step.evaluation.peak_bytes
    assert live["params"] == 4 * psi  # the traced model is fp32
    assert b["activations_bytes"] == live["saved"] + live["recomputed"] + live["temporaries"]


def test_fit_answer_fits_and_the_next_value_does_not(user_file, tmp_path, capsys):
    budget = 600_000
    out = tmp_path / "fit.json"
    argv = ["fit", f"{user_file}:build", "--budget", str(budget), "--vary", "batch_size",
            "--set", "depth=2", "--max", "4096", "--out", str(out), "--quiet", "--solver", "chen-greedy"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    answer = data["answer"]
    assert answer is not None and not data["hit_maximum"] and 1 < answer < 4096
    probes = {p["value"]: p for p in data["probes"]}
    assert probes[answer]["fits"] and not probes[answer + 1]["fits"]
    _, planned = _plan_like_the_cli(user_file, budget, batch_size=answer, depth=2)
    assert planned.predicted_peak_bytes <= budget
    with pytest.raises(remat.InfeasibleBudgetError):
        built = target.call_factory(target.load_factory(f"{user_file}:build"), "build",
                                    {"batch_size": answer + 1, "depth": 2})
        remat.plan(built.model, built.args, built.kwargs, budget=budget, solver="chen-greedy")
    assert probes[answer + 1]["min_peak_bytes"] > budget
    # the answer, the nearest value that does not fit, and each one's floor
    nearest_floor = format_bytes(probes[answer + 1]["min_peak_bytes"])
    assert f"batch_size={answer} fits {budget}: predicted peak " in printed and ", floor " in printed
    assert f"batch_size={answer + 1} does not: its floor is {nearest_floor}" in printed


@pytest.mark.parametrize(("argv_tail", "needle"), [
    (["{dir}/mymodel.py"], "no ':factory' part"),
    (["{dir}/missing.py:build"], "does not exist"),
    (["no_such_package_xyz.mod:build"], "cannot import module"),
    (["{dir}/mymodel.py:buidl"], "defines no 'buidl'"),
    (["{dir}/mymodel.py:NOT_A_FUNCTION"], "not a function"),
    (["{dir}/mymodel.py:wrong"], "return (model, args) or (model, args, kwargs)"),
    (["{dir}/broken.py:build"], "raised NameError: name 'undefined_name' is not defined"),
    (["{dir}/mymodel.py:build", "--set", "batch_size"], "is not name=value"),
    (["{dir}/mymodel.py:build", "--set", "batch=8"], "takes no argument 'batch'"),
    (["{dir}/mymodel.py:build", "--budget", "lots"], "cannot parse budget"),
])
def test_bad_input_is_one_line_and_exit_code_2(user_file, tmp_path, capsys, argv_tail, needle):
    (user_file.parent / "broken.py").write_text("import torch\nundefined_name\n")
    tail = [a.format(dir=user_file.parent) for a in argv_tail]
    argv = ["report", *tail[:1], "--out", str(tmp_path), "--quiet", *tail[1:]]
    if "--budget" not in argv:
        argv += ["--budget", "60%"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("remat: error:") and needle in err, err
    assert not (tmp_path / "report.json").exists()


def test_a_budget_below_the_floor_is_answered_with_the_floors_report_and_exit_1(user_file, tmp_path, capsys):
    """"Will it fit?" answered "no" is an answer: every file is written, for the plan at
    the smallest reachable peak, and the exit code is 1 (not 2, a usage error)."""
    argv = ["report", f"{user_file}:build", "--budget", "1KB", "--out", str(tmp_path), "--quiet",
            "--pareto-points", "2"]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "below the smallest reachable peak" in captured.err
    assert "does NOT fit:      budget 0.00 MiB (1000 B)" in captured.out
    for name in ("report.json", "report.html", "timeline.png", "pareto.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["status"] == "infeasible" and data["requested_budget_bytes"] == 1000
    _, at_floor = _plan_like_the_cli(user_file, data["budget_bytes"])  # the plan shown runs there
    assert data["predicted_peak_bytes"] == at_floor.predicted_peak_bytes <= data["budget_bytes"]
    assert data["min_peak_bytes"] <= data["budget_bytes"] and data["pareto"] and data["breakdown"]


def test_a_report_below_the_floor_searches_the_floor_once(user_file, tmp_path, monkeypatch):
    """The refusal, the re-plan at the floor and the Pareto sweep share one floor search
    (`remat.planning.floor.least_peak`): on LLaMA-7B's 32 layers each search is seconds of ILP."""
    from collections import OrderedDict

    from remat.planning import floor

    searches = []
    search = floor.least_peak_plan
    monkeypatch.setattr(floor, "_FLOOR_PLANS", OrderedDict())  # nothing remembered from other tests
    monkeypatch.setattr(floor, "least_peak_plan", lambda *a, **k: searches.append(a) or search(*a, **k))
    argv = ["report", f"{user_file}:build", "--budget", "1KB", "--out", str(tmp_path), "--quiet",
            "--pareto-points", "3"]
    assert cli.main(argv) == 1
    assert len(searches) == 1


def test_a_report_below_the_floor_traces_the_step_once(user_file, tmp_path, monkeypatch):
    """The refused budget and the floor's plan come from one trace of the training step
    (on LLaMA-7B, a trace is a quarter of the report's time)."""
    import remat.api

    traces = []
    trace = remat.api.compile_joint
    monkeypatch.setattr(remat.api, "compile_joint", lambda *a, **k: traces.append(a) or trace(*a, **k))
    argv = ["report", f"{user_file}:build", "--budget", "1KB", "--out", str(tmp_path), "--quiet",
            "--pareto-points", "2"]
    assert cli.main(argv) == 1
    assert len(traces) == 1


def test_fit_refuses_a_percentage_budget(user_file, capsys):
    assert cli.main(["fit", f"{user_file}:build", "--budget", "50%", "--vary", "batch_size", "-q"]) == 2
    assert "absolute budget" in capsys.readouterr().err


def test_python_dash_m_remat_is_the_cli():
    run = subprocess.run([sys.executable, "-m", "remat", "report", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "TARGET" in run.stdout and "--fake" in run.stdout


@pytest.mark.skipif(shutil.which("chromium") is None and not Path("/usr/bin/chromium").exists(),
                    reason="headless Chromium is not installed (apt-get install chromium)")
def test_report_html_renders_in_headless_chromium(report_dir, tmp_path):
    import matplotlib.image

    shot = tmp_path / "report.png"
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,1800", f"--screenshot={shot}", (report_dir / "report.html").as_uri()],
                   capture_output=True, timeout=180, check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1800, 1200)
    # the two figures drew: many distinct colours, not a blank or an error page
    assert pixels[:900].std() > 0.05
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).round(2)}) > 50


def test_offload_on_reaches_below_the_recompute_floor_and_reports_it(user_file, tmp_path):
    built = target.call_factory(target.load_factory(f"{user_file}:build"), "build", {"batch_size": 256})
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(built.model, built.args, built.kwargs, budget=1, offload=False)
    budget = refused.value.min_peak_bytes - 1  # below every recompute-only plan
    argv = ["report", f"{user_file}:build", "--budget", str(budget), "--offload", "on", "--out", str(tmp_path),
            "--set", "batch_size=256", "--pareto-points", "4", "--quiet"]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    offloaded = [r for r in data["decisions"] if r["decision"] == "offload"]
    assert offloaded and data["predicted_peak_bytes"] <= budget
    # the transfers take time; how much of it overlapping compute hides depends on this
    # machine's measured FLOP/s against its bandwidth (the roofline), so only its bound
    assert data["transfer_s"] > 0 and 0 <= data["offload_s"] <= data["transfer_s"]
    assert data["offloaded_bytes"] == sum(r["bytes"] for r in offloaded)
    assert data["breakdown"]["activations_offloaded_bytes"] == sum(r["bytes"] for r in offloaded)
    pareto = data["pareto"]
    assert all(b["extra_time_s"] <= a["extra_time_s"] for a, b in zip(pareto, pareto[1:]))
    here = [p for p in pareto if p["budget_bytes"] == data["budget_bytes"]]
    assert here and here[0]["extra_time_s"] <= data["extra_compute_s"] + data["offload_s"]
