"""remat under real torch.distributed: 2 gloo processes on CPU, spawned once for the
module (`dist_scenarios.py` runs every scenario in each rank), a transformers Qwen2,
each rank on its own data. Asserts per rank: DDP gradients bit-equal to DDP(model),
the same all-reduce buckets and gradient hooks, one plan on every rank, collectives
never recomputed, FSDP2 compositions that cannot work refused with a RematError, and
FSDP2 through the compile backend: eager FSDP2's gradients and collectives, a lower peak;
compiled DDP (DDPOptimizer's bucket graphs) under one whole-step budget, and DDP and
FSDP2 through the backend with inductor at a percentage of inductor's no-remat peak."""

import multiprocessing
import multiprocessing.forkserver
import pickle
import socket

import pytest
import torch.multiprocessing as mp

import dist_scenarios
from nets import needs_torch

TIMEOUT_S = 900  # a backstop only: a hung collective raises after 120 s (init timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ("dist_scenarios", "transformers.models.qwen2.modeling_qwen2", "torch.distributed.fsdp",
           "torch.nn.parallel")
"""Imported once by the fork server the ranks fork from: a spawned rank imports torch,
transformers and remat itself, about 6-8 s CPU per rank (measured), a third of its work."""


def _start_method() -> str:
    """'forkserver' with PRELOAD, unless this process already runs a fork server (started
    without our preload, it would not have this directory on its path): then 'spawn'."""
    if multiprocessing.forkserver._forkserver._forkserver_pid is not None:
        return "spawn"
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{scenario: facts} per rank, from one spawn of WORLD processes."""
    out = tmp_path_factory.mktemp("ranks")
    names = tuple(dist_scenarios.SCENARIOS)
    context = mp.start_processes(dist_scenarios.worker, args=(_free_port(), str(out), names),
                                 nprocs=dist_scenarios.WORLD, join=False, start_method=_start_method())
    for process in context.processes:
        process.join(TIMEOUT_S)
    alive = [p for p in context.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"ranks still running after {TIMEOUT_S} s (a collective hung)"
    assert all(p.exitcode == 0 for p in context.processes), [p.exitcode for p in context.processes]
    results = []
    for rank in range(dist_scenarios.WORLD):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _facts(ranks, name):
    facts = [r[name] for r in ranks]
    for rank, f in enumerate(facts):
        assert "traceback" not in f, f"rank {rank}, scenario {name}:\n{f['traceback']}"
    return facts


def test_ddp_over_planned_model_matches_ddp_bit_for_bit(ranks):
    facts = _facts(ranks, "ddp")
    for f in facts:
        assert f["recomputed"] > 0  # the plan does rematerialize
        assert f["grads_equal"]
    # each rank ran its own data, and DDP averaged the gradients to one value
    assert facts[0]["losses"] != facts[1]["losses"]
    assert facts[0]["grad_checksum"] == facts[1]["grad_checksum"]


def test_ddp_buckets_and_hooks_fire_as_for_the_plain_model(ranks):
    for f in _facts(ranks, "ddp"):
        ours, theirs = f["buckets"]
        for step in (0, 1):
            mine = [b for b in ours if b[0] == step]
            plain = [b for b in theirs if b[0] == step]
            # Every gradient element all-reduced once per step, as for the plain model.
            assert sum(b[2] for b in mine) == sum(b[2] for b in plain) == f["num_elements"]
        # Step 0: the same buckets (DDP's first is 1 MB: all in one). Then DDP rebuilds its
        # buckets in gradient-ready order, which differs: remat's backward is one autograd
        # node, so its gradients become ready together (measured: 4 buckets packed in
        # remat's order, 3 in eager's)
        assert [b for b in ours if b[0] == 0] == [b for b in theirs if b[0] == 0]
        assert len([b for b in ours if b[0] == 1]) >= 3
        accumulated_ours, accumulated_theirs = f["accumulated"]
        assert accumulated_ours == accumulated_theirs
        assert len(accumulated_ours) == f["num_params"] and set(accumulated_ours.values()) == {2}


def test_every_rank_runs_rank_zeros_plan(ranks):
    ddp = _facts(ranks, "ddp")
    assert ddp[0]["decisions"] == ddp[1]["decisions"]
    agree = _facts(ranks, "agree")
    assert agree[0] == agree[1] == {"solver": "none", "decisions": agree[0]["decisions"]}


def test_collectives_are_never_recomputed(ranks):
    for f in _facts(ranks, "funcol"):
        assert f["recomputed"] > 0  # 'all' recomputed what it could ...
        assert f["backward_collectives"] == []  # ... but no collective
        assert f["forward_collectives"].count("_c10d_functional.all_reduce.default") == 1
        assert f["grads_equal"]


def test_plan_refuses_an_fsdp2_sharded_model(ranks):
    for f in _facts(ranks, "fsdp2_plan"):
        assert f["error"] is not None
        assert "FSDP2" in f["error"] and "remat.backend" in f["error"]


def test_fsdp2_through_the_compile_backend(ranks):
    """fully_shard on the layers and the root, then torch.compile(backend=remat.backend):
    gradients bit-equal to eager FSDP2's, the same all-gathers and reduce-scatters, one
    whole-step budget that counts FSDP2's own memory, measured <= predicted <= budget per
    rank, and a lower measured per-rank peak than eager FSDP2's."""
    facts = _facts(ranks, "fsdp2_compile")
    for f in facts:
        assert f["grads_equal"]
        eager, ours = f["collectives"]
        assert ours == eager and eager["c10d::_allgather_base_"] > 0 and eager["c10d::_reduce_scatter_base_"] > 0
        # one budget for the whole step: every graph call's plan fits it with what is
        # held outside the call (earlier layers' saved activations, parameters, gradients)
        budget, predicted, calls = f["step"]
        assert all(peak <= predicted for _, peak in calls) and predicted <= budget
        # FSDP2's sharded parameters and gradients are no graph's arguments: the ledger
        # counts them (and FSDP2's buffers) outside even the step's first graph call
        assert f["first_call_outside_bytes"] >= 2 * f["sharded_bytes"]
        eager_peak, our_peak = f["peak_bytes"]
        assert our_peak <= predicted  # measured (what existed before the step + the rise)
        assert len(calls) == 4  # embedding, 2 layers (one graph), head
        assert max(recomputed for *_, recomputed in f["graphs"]) > 0
        # a layer's unsharded parameters are inputs of its graph: live, and counted,
        # from the all-gather before it to the reshard after it
        assert f["layer_graph_source_bytes"] >= f["layer_unsharded_bytes"]
        assert our_peak < eager_peak
    assert facts[0]["decisions"] == facts[1]["decisions"]


def test_fsdp2_through_the_backend_with_inductor_plans_a_percentage_on_every_rank(ranks):
    """A percentage under FSDP2 through the backend (inductor): every rank plans it, of
    the whole step's no-remat peak as inductor generates each graph, and trains like
    eager FSDP2. (A call's share in the first step may be below its floor: that step runs
    best effort, `remat.runtime.inductor.closed_loop`.)"""
    for f in _facts(ranks, "fsdp2_percentage"):
        assert f["grads_close"]
        budget, no_remat, predicted = f["step"]
        assert budget == int(0.9 * no_remat) and predicted <= budget
        assert f["margins_known"] and f["calls"] == 4


def test_ddp_through_the_backend_with_inductor_plans_a_percentage_on_every_rank(ranks):
    """A percentage under DDP through the backend (inductor): DDPOptimizer's two bucket
    graphs share one budget, a percentage of the whole step's no-remat peak as inductor
    generates each graph, and the step trains like eager DDP; every rank runs the same."""
    facts = _facts(ranks, "ddp_percentage")
    for f in facts:
        assert f["grads_close"]
        budget, no_remat, predicted = f["step"]
        assert budget == int(0.9 * no_remat) and predicted <= budget
        assert f["margins_known"] and f["graphs"] == 2
    assert facts[0]["step"] == facts[1]["step"]


@needs_torch(2, 13, "the eager FSDP2 reference runs with torch.compiler.is_compiling() set (the code "
             "path dynamo traces), and torch 2.11's FSDP2 asserts in its lazy init there, and once "
             "initialized saves a bf16 parameter it then overwrites in place")
def test_fsdp2_mixed_precision_recompute_is_bit_exact(ranks):
    """MixedPrecisionPolicy(param_dtype=bf16): bf16 values recomputed in backward, fp32
    sharded gradients equal to eager FSDP2's on the same code path; the next step's
    measured peak under the ledger's prediction (bf16 all-gathers, fp32 gradients)."""
    for f in _facts(ranks, "fsdp2_bf16"):
        assert f["grads_equal"]
        assert f["grad_dtypes"] == ["torch.float32"]
        assert "torch.bfloat16" in f["recomputed_dtypes"]
        measured, predicted, budget = f["step"]
        assert measured <= predicted <= budget


def test_compiled_ddp_one_budget_for_every_bucket_graph(ranks):
    """torch.compile(DDP(model), backend=remat.backend(compiler="eager")): DDPOptimizer
    splits the graph at bucket boundaries (1 MB buckets: 2 graphs); one whole-step budget
    for all of them, gradients bit-equal to eager DDP's."""
    facts = _facts(ranks, "ddp_compile")
    for f in facts:
        assert f["grads_equal"]
        assert f["graphs"] == 2 and f["recomputed"] > 0
        budget, predicted, calls = f["step"]
        assert all(peak <= predicted for peak in calls) and predicted <= budget
        # DDP's bucket buffers (as many bytes as the gradients) live outside every graph:
        # counted, measured <= predicted
        assert f["bucket_bytes"] > 0 and f["measured_bytes"] <= predicted
    assert facts[0]["step"] == facts[1]["step"]  # one plan, one split on every rank
