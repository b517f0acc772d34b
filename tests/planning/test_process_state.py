"""Same inputs, same plan, in any process: a model planned in a fresh process and again in
this one, after plans under another intra-op thread count (whose device figures differ:
`costs.device_key` keys them by threads), gets the same decisions. The offload link
bandwidth on CPU is read for the current thread count at each plan: kept per process
from its first use, a plan with offload would depend on the thread count of whatever
planned first in the worker (a transposed BatchNorm model at 75% with offload would
find no OFFLOAD decision after other tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import remat
from remat.frontend import costs

SCRIPT = """
import json, sys, torch, remat
sys.path.insert(0, {tests!r})
from test_process_state import plan_decisions
print(json.dumps(plan_decisions()))
"""


def plan_decisions() -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(256, 64)
    planned = remat.plan(with_loss(model), (x,), budget="75%", solver="greedy", offload=True)
    return [d.value for _, d in sorted(planned.plan.decisions.items())]


def with_loss(model: torch.nn.Module) -> torch.nn.Module:
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).square().mean()

    return WithLoss()


def _figures(tmp: Path, threads: int, bandwidth: float) -> None:
    """A device-speed cache entry for `threads` threads with the given bandwidth."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        key = costs.device_key("cpu")
    finally:
        torch.set_num_threads(before)
    table = json.loads((tmp / costs.CACHE_FILE).read_text()) if (tmp / costs.CACHE_FILE).exists() else {}
    table[key] = {"peak_flops_per_s": 1e10, "bandwidth_bytes_per_s": bandwidth}
    (tmp / costs.CACHE_FILE).write_text(json.dumps(table))


def test_a_plan_does_not_depend_on_the_plans_made_before_it_in_the_process(tmp_path, monkeypatch):
    # figures that favour offload at the thread count this test plans with, figures that
    # forbid it in practice (a crawling link) at another one
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    _figures(tmp_path, threads, bandwidth=1e12)
    _figures(tmp_path, other, bandwidth=1.0)
    monkeypatch.setenv(costs.CACHE_ENV, str(tmp_path))
    env = {**os.environ, costs.CACHE_ENV: str(tmp_path), "OMP_NUM_THREADS": str(threads)}
    fresh = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))],
                           capture_output=True, text=True, env=env, check=True, timeout=600)
    expected = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert "offload" in expected
    torch.set_num_threads(other)
    try:
        plan_decisions()  # a plan under the other figures first
    finally:
        torch.set_num_threads(threads)
    assert plan_decisions() == expected
