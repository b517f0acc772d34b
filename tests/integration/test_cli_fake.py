"""`remat report --fake`: a LLaMA-7B-shaped model (hidden 4096, 2k tokens; fewer layers
for test time) built on the meta device is planned without allocating its weights, and
fake planning of a small model gives the real planning's numbers under the same cost
model."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import remat.cli.main as cli
from remat.frontend.fake import build_fake

pytest.importorskip("transformers")

LLAMA_7B = Path(__file__).resolve().parents[2] / "examples" / "llama7b_factory.py"

RUN_AND_REPORT_RSS = textwrap.dedent('''
    import resource, sys
    import remat.cli.main as cli
    code = cli.main(sys.argv[1:])
    print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    sys.exit(code)
''')


def test_fake_plans_a_llama_7b_shaped_model_without_allocating_it(tmp_path):
    out = tmp_path / "report"
    argv = [f"{LLAMA_7B}:build", "--budget", "85%", "--fake", "--device", "h100",
            "--set", "layers=2", "--set", "batch_size=4", "--out", str(out), "--pareto-points", "5", "--solver", "chen-greedy",
            "--quiet"]
    run = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_RSS, "report", *argv], capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((out / "report.json").read_text())
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # attention, MLP, two RMSNorms
    psi = 2 * layer + 2 * 32000 * 4096 + 4096  # + embedding, untied head, final norm
    assert data["fake"] and "h100" in data["cost_model"]
    assert data["breakdown"]["trainable_params"] == psi
    # fp32 weights alone are 2.7 GB; planning them must not allocate them
    assert data["baseline_peak_bytes"] > 2 * 4 * psi
    rss_bytes = int(run.stdout.split("MAXRSS_KIB")[1].split()[0]) * 1024
    assert rss_bytes < 4 * psi / 2, f"max RSS {rss_bytes / 2**30:.2f} GiB"
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] and len(data["pareto"]) >= 5


def test_fake_planning_equals_real_planning_under_the_same_cost_model(tmp_path):
    (tmp_path / "small.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def build(batch_size=32, width=32):
            torch.manual_seed(0)
            blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                      for _ in range(3)]
            return nn.Sequential(*blocks), (torch.randn(batch_size, width),)
    '''))
    # the factory's model must return a scalar loss; a sibling import works as when run
    (tmp_path / "wrapped.py").write_text(textwrap.dedent('''
        import torch
        from small import build as inner

        class Loss(torch.nn.Module):
            def __init__(self, net):
                super().__init__()
                self.net = net

            def forward(self, x):
                return self.net(x).square().mean()

        def build(batch_size=32):
            net, args = inner(batch_size)
            return Loss(net), args
    '''))
    reports = {}
    for mode in ("real", "fake"):
        out = tmp_path / mode
        argv = ["report", f"{tmp_path / 'wrapped.py'}:build", "--budget", "80%", "--device", "a100",
                "--set", "batch_size=128", "--out", str(out), "--pareto-points", "3", "--quiet"]
        argv += ["--fake"] if mode == "fake" else []
        assert cli.main(argv) == 0
        reports[mode] = json.loads((out / "report.json").read_text())
    real, fake = reports["real"], reports["fake"]
    assert fake["fake"] and not real["fake"]
    assert any(row["decision"] == "recompute" for row in real["decisions"])  # a real trade-off
    for key in ("budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes", "min_peak_bytes",
                "extra_compute_s", "decisions", "timeline", "pareto", "breakdown"):
        assert fake[key] == real[key], key


def test_build_fake_keeps_tied_weights_and_grad_flags():
    import torch
    from torch import nn

    def factory():
        with torch.device("meta"):
            emb = nn.Embedding(10, 4)
            head = nn.Linear(4, 10, bias=False)
            head.weight = emb.weight
            frozen = nn.Linear(4, 4)
            frozen.requires_grad_(False)
        return nn.ModuleList([emb, head, frozen]), (torch.ones(3, device="meta"),)

    (model, args), _ = build_fake(factory)
    from torch._subclasses.fake_tensor import FakeTensor

    assert model[0].weight is model[1].weight
    assert all(isinstance(p, FakeTensor) and p.device.type == "cpu" for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == [True, False, False]
    assert isinstance(args[0], FakeTensor) and args[0].device.type == "cpu"


def test_outputs_loss_frees_the_logits_in_the_report(tmp_path):
    """`--outputs loss`: the training loop keeps only the loss, so the logits (batch x
    tokens x vocab) are not held through backward and the no-remat peak drops by their
    bytes; planned on fake tensors, as for a model bigger than the machine."""
    (tmp_path / "gpt2.py").write_text(textwrap.dedent('''
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        def build(batch_size=2, seq_len=64):
            config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=seq_len,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
            model = GPT2LMHeadModel(config)
            model.loss_type = "ForCausalLM"
            ids = torch.randint(0, 1000, (batch_size, seq_len))
            return model, (ids,), {"labels": ids}
    '''))
    reports = {}
    for outputs in ("all", "loss"):
        out = tmp_path / outputs
        argv = ["report", f"{tmp_path / 'gpt2.py'}:build", "--budget", "90%", "--fake", "--device", "h100",
                "--out", str(out), "--pareto-points", "2", "--solver", "greedy", "--outputs", outputs, "--quiet"]
        assert cli.main(argv) == 0
        reports[outputs] = json.loads((out / "report.json").read_text())
    logits_bytes = 2 * 64 * 1000 * 4
    assert reports["all"]["baseline_peak_bytes"] - reports["loss"]["baseline_peak_bytes"] == logits_bytes
