"""The model-state formulas of the breakdown (ZeRO's table, sharding stages, LoRA and
QLoRA) and `fit`'s search, on numbers small enough to check by hand."""

import pytest
from torch import nn

from remat.cli.fit import Probe, search
from remat.report.breakdown import TrainingOptions, count_parameters, model_state


@pytest.mark.parametrize(("optimizer", "precision", "per_param"), [
    ("sgd", "fp32", (4, 4, 0, 0)),
    ("sgd-momentum", "fp32", (4, 4, 0, 4)),
    ("adam", "fp32", (4, 4, 0, 8)),
    ("adamw", "bf16-mixed", (2, 2, 4, 8)),  # ZeRO: 2 + 2 + 12 = 16 bytes per parameter
    ("sgd", "fp16-mixed", (2, 2, 4, 0)),
])
def test_state_bytes_per_parameter(optimizer, precision, per_param):
    state = model_state(1000, 0, TrainingOptions(optimizer=optimizer, precision=precision))
    assert tuple(state.values()) == tuple(1000 * b for b in per_param)


@pytest.mark.parametrize(("stage", "divided"), [(1, ("master", "optimizer")),
                                                (2, ("gradients", "master", "optimizer")),
                                                (3, ("weights", "gradients", "master", "optimizer"))])
def test_sharding_divides_by_stage(stage, divided):
    full = model_state(1000, 0, TrainingOptions(precision="bf16-mixed"))
    sharded = model_state(1000, 0, TrainingOptions(precision="bf16-mixed", shard=8, zero_stage=stage))
    for key, value in sharded.items():
        expected = full[key] // 8 if key.removesuffix("_bytes") in divided else full[key]
        assert value == expected, key


def test_lora_and_qlora_count_frozen_base_weights_only_as_weights():
    lora = model_state(10, 8000, TrainingOptions(precision="bf16-mixed", adapter="lora"))
    assert lora == {"weights_bytes": 2 * 8010, "gradients_bytes": 20, "master_bytes": 40, "optimizer_bytes": 80}
    qlora = model_state(10, 8000, TrainingOptions(precision="bf16-mixed", adapter="qlora"))
    # NF4 base: 4 bits + 0.127 bits of double-quantized constants per frozen parameter
    assert qlora["weights_bytes"] == 20 + 4127
    assert {k: v for k, v in qlora.items() if k != "weights_bytes"} == {
        k: v for k, v in lora.items() if k != "weights_bytes"}


def test_count_parameters_splits_frozen_from_trainable_and_counts_tied_once():
    base = nn.Linear(16, 16)
    base.requires_grad_(False)
    adapter_a, adapter_b = nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False)
    emb, head = nn.Embedding(5, 16), nn.Linear(16, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleList([base, adapter_a, adapter_b, emb, head])
    model.register_buffer("scale", nn.Parameter(nn.init.ones_(nn.Linear(1, 3).weight)).detach())
    assert count_parameters(model) == (32 + 32 + 80, 16 * 16 + 16, 3 * 4)


def test_bad_options_name_the_valid_ones():
    with pytest.raises(ValueError, match="optimizer='lion' is not one of"):
        TrainingOptions(optimizer="lion")
    with pytest.raises(ValueError, match="shard=0 must be an int >= 1"):
        TrainingOptions(shard=0)


def _threshold(limit, seen):
    def probe(v):
        seen.append(v)
        return Probe(value=v, fits=v <= limit, predicted_peak_bytes=v if v <= limit else None,
                     min_peak_bytes=None if v <= limit else v, seconds=0.0)
    return probe


@pytest.mark.parametrize("limit", [1, 2, 3, 37, 64, 65, 1000])
def test_fit_search_finds_the_boundary_with_log_probes(limit):
    seen = []
    result = search(_threshold(limit, seen), start=1)
    assert result.answer == limit and not result.hit_maximum
    assert len(seen) == len(set(seen)) <= 2 * limit.bit_length() + 1


def test_fit_search_respects_max_and_start():
    assert search(_threshold(1000, []), start=1, maximum=100).answer == 100
    assert search(_threshold(1000, []), start=1, maximum=100).hit_maximum
    assert search(_threshold(5, []), start=8).answer is None
    assert search(_threshold(50, []), start=8, maximum=40).answer == 40


def test_progress_appears_only_after_the_delay_and_never_when_quiet():
    import time

    from remat.cli.progress import Stages

    assert not Stages(quiet=True).enabled
    stages = Stages(delay_s=0.05)
    stages.enabled = True  # as on a terminal
    with stages.stage("slow") as advance:
        time.sleep(0.3)
        advance(1, 2)
        assert advance.__self__.started  # the bar is up
    with stages.stage("quick") as advance:
        pass
    assert not advance.__self__.started  # closed before the delay: never drawn
    assert [name for name, _ in stages.log] == ["slow", "quick"] and stages.log[0][1] >= 0.3


def test_the_progress_follows_the_planners_stages_quietly(capsys):
    import torch

    import remat
    from remat.cli.progress import Stages

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    loss_model = _ScalarLoss(model)
    stages = Stages(delay_s=0.0)
    stages.enabled = True
    with stages.planning(verbose=False):
        remat.plan(loss_model, (torch.randn(4, 8),), budget="100%", solver="none")
    assert stages.planner_stages == ("profile", "solve", "rewrite")
    assert "solving" not in capsys.readouterr().err  # the records fed the bar, not the log


class _ScalarLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).square().mean()
