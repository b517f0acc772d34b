"""Scenarios run inside each rank of a real gloo process group (spawned by
`test_distributed.py`, once per test module). Each returns plain facts that the tests
assert on in the parent: equality verdicts, counts, decisions. Nothing is mocked: the
collectives are gloo's, the model is a transformers Qwen2 built from a config."""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import re
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import remat

WORLD = 2


def qwen2(layers: int = 2, hidden: int = 64) -> nn.Module:
    """A narrow Qwen2 causal LM, seeded: the same weights on every rank."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         use_cache=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).train()


def rank_batch(rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Each rank its own tokens (and each step its own)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, 128, (4, 32), generator=gen)
    return {"input_ids": ids, "labels": ids}


class CountingHooks:
    """DDP's default all-reduce, counted: which buckets fired and how large they were,
    and how many gradients were accumulated per parameter."""

    def __init__(self, model: nn.Module) -> None:
        self.step = 0
        self.buckets: list[tuple[int, int, int]] = []  # (step, bucket index, numel)
        self.accumulated: Counter[str] = Counter()
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, name=name: self.accumulated.update([name]))

    def allreduce(self, state, bucket):  # unannotated: DDP checks the hook's annotations
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.buckets.append((self.step, bucket.index(), bucket.buffer().numel()))
        return allreduce_hook(state, bucket)


def ddp_grads_equal() -> dict[str, Any]:
    """DDP(remat.plan(model)) against DDP(model), two steps, each rank its own data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = qwen2()
    reference = copy.deepcopy(model)
    planned = remat.plan(model, (), rank_batch(rank), budget="70%", solver="chen-greedy")
    # Small buckets (0.1 MB of ~0.36 MB of gradients): several all-reduces per step.
    ours, theirs = DDP(planned, bucket_cap_mb=0.1), DDP(reference, bucket_cap_mb=0.1)
    hooks_ours, hooks_theirs = CountingHooks(model), CountingHooks(reference)
    ours.register_comm_hook(None, hooks_ours.allreduce)
    theirs.register_comm_hook(None, hooks_theirs.allreduce)
    losses = []
    for step in range(2):
        hooks_ours.step = hooks_theirs.step = step
        batch = rank_batch(rank, step)
        loss = ours(**batch).loss
        loss.backward()
        theirs(**batch).loss.backward()
        losses.append(loss.item())
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    ref_grads = dict(reference.named_parameters())
    return {
        "grads_equal": all(torch.equal(g, ref_grads[n].grad) for n, g in grads),
        "losses": losses,
        "grad_checksum": float(sum(g.double().sum() for _, g in grads)),
        "buckets": (hooks_ours.buckets, hooks_theirs.buckets),
        "accumulated": (dict(hooks_ours.accumulated), dict(hooks_theirs.accumulated)),
        "num_params": len(grads),
        "num_elements": sum(g.numel() for _, g in grads),
        "recomputed": len(planned.step.evaluation.recomputed_ids),
        "decisions": tuple(d.value for d in planned.plan.decisions.values()),
        "library_trace_path": planned.step.library_trace_path,
    }


def ddp_compiled() -> dict[str, Any]:
    """torch.compile(DDP(model), backend=remat.backend) against eager DDP(model): DDPOptimizer
    splits the graph at bucket boundaries, one whole-step budget for all."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    base = qwen2(hidden=128)
    reference = copy.deepcopy(base)
    backend = remat.backend(budget="90%", solver="chen-greedy", compiler="eager")
    # 1 MB buckets (DDP's first bucket is 1 MB) of ~1.3 MB of gradients: two graphs
    ours = torch.compile(DDP(base, bucket_cap_mb=1), backend=backend)
    # eager DDP: dynamo runs transformers' compile path (an explicit causal mask), whose
    # fp32 gradients here are eager's bit for bit (measured; cheaper than a second compile)
    theirs = DDP(reference, bucket_cap_mb=1)
    batch = rank_batch(rank, 0)
    for run in (ours, theirs):  # the first step compiles and learns the split
        run(**batch).loss.backward()
    # The second step runs the split, measured: what was live before it (parameters, the
    # batch, and the reducer's bucket buffers, as DDP itself reports them) + the profiler's
    # rise. DDP rebuilds its buckets (in gradient-ready order) as the second forward starts,
    # the new ones allocated before the old are freed; rebuilt here first, as torch's own
    # Join hook does, so that the profiler sees neither (else it sees the new allocated but
    # not the old freed: made before it started)
    ours._orig_mod.reducer._rebuild_buckets()
    batch = rank_batch(rank, 1)
    for model in (base, reference):
        model.zero_grad(set_to_none=True)
    buckets = sum(int(n) for n in re.findall(r"\d+", ours._orig_mod._get_ddp_logging_data()["bucket_sizes"]))
    census = _census_bytes(base, batch) + buckets
    measured = census + _profiled(lambda: ours(**batch).loss.backward())[1]
    theirs(**batch).loss.backward()
    grads_equal = all(torch.equal(a.grad, b.grad) for a, b in zip(base.parameters(), reference.parameters()))
    ledger = backend.ledger
    return {
        "grads_equal": grads_equal,
        "measured_bytes": measured,
        "bucket_bytes": buckets,
        "graphs": len({c.graph for c in ledger.last_step}),
        "step": (ledger.budget_bytes, ledger.predicted_step_bytes,
                 [c.outside_bytes + c.peak_bytes for c in ledger.last_step]),
        "recomputed": sum(len(s.evaluation.recomputed_ids) for s in backend.steps),
    }


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def plans_agree() -> dict[str, Any]:
    """Ranks asking for different solvers still run one plan: rank 0's."""
    rank = dist.get_rank()
    planned = remat.plan(TwoLayer(), (torch.randn(16, 32),), budget="100%",
                         solver="none" if rank == 0 else "all")
    return {"solver": planned.plan.solver,
            "decisions": tuple(d.value for d in planned.plan.decisions.values())}


class AllReduceScale(TwoLayer):
    """TwoLayer's layers, with a forward that all-reduces a statistic (as tensor/sequence
    parallel layers do) and uses it in a differentiable product, so backward needs the
    collective's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        h = torch.tanh(self.a(x))
        scale = funcol.all_reduce(h.detach().pow(2).mean(), "sum", dist.group.WORLD)
        return (torch.tanh(self.b(h)) * scale).sum()


def _collective_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and "c10d" in str(n.target)]


def collectives_never_recomputed() -> dict[str, Any]:
    """Plan a forward with a functional all_reduce under the 'recompute everything' solver."""
    rank = dist.get_rank()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    model = AllReduceScale()
    reference = copy.deepcopy(model)
    planned = remat.plan(model, (x,), budget="100%", solver="all")
    planned(x).backward()
    reference(x).backward()
    return {
        "forward_collectives": _collective_nodes(planned.step.forward),
        "backward_collectives": _collective_nodes(planned.step.backward),
        "recomputed": len(planned.step.evaluation.recomputed_ids),
        "grads_equal": all(torch.equal(a.grad, b.grad)
                           for a, b in zip(model.parameters(), reference.parameters())),
    }


def fsdp2_plan_refused() -> dict[str, Any]:
    """remat.plan over a fully_shard-ed model: a CompositionError, before any tracing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = qwen2(layers=2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        remat.plan(model, (), rank_batch(dist.get_rank()), budget="70%")
    except remat.CompositionError as e:
        return {"error": str(e)}
    return {"error": None}


def _shard(model: nn.Module, **fsdp_kwargs: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _profiled(fn: Callable[[], Any]) -> tuple[dict[str, int], int]:
    """c10d collectives the step ran (profiler events), and its measured peak bytes
    above what existed before (profiler allocator events: dispatch modes would make
    dynamo fall back to eager)."""
    from torch.profiler import ProfilerActivity, profile

    from remat.testing.measure import _allocation_events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = high = 0
    for _, _, size in _allocation_events(prof, torch.device("cpu")):
        running += size
        high = max(high, running)
    return dict(Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))), high


FSDP2_STEP_BUDGET = "85%"
"""Of the whole step's no-remat peak (the ledger's), shared by every graph call."""


def _census_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes live before a step that the profiler's peak (a rise above the start) leaves
    out: the sharded parameters and gradients, and the batch (each storage once)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += list(batch.values())
    return sum({StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


def fsdp2_compiled() -> dict[str, Any]:
    """torch.compile(fully_shard-ed Qwen2, backend=remat.backend) against eager FSDP2."""
    rank = dist.get_rank()
    base = qwen2()
    eager, ours = _shard(copy.deepcopy(base)), _shard(base)
    backend = remat.backend(budget=FSDP2_STEP_BUDGET, solver="chen-greedy", compiler="eager")
    runs = {"eager": (eager, eager), "remat": (ours, torch.compile(ours, backend=backend))}
    facts: dict[str, Any] = {}
    for name, (model, run) in runs.items():
        run(**rank_batch(rank, 0)).loss.backward()  # compiles
        batch = rank_batch(rank, 1)
        census = _census_bytes(model, batch)
        collectives, rise = _profiled(lambda run=run, batch=batch: run(**batch).loss.backward())
        facts[name] = (collectives, census + rise)
    layer = base.model.layers[0]
    steps = backend.steps
    biggest = max(steps, key=lambda s: len(s.graph_problem.problem.nodes))
    problem = biggest.graph_problem.problem
    return {
        "grads_equal": all(torch.equal(a.grad.to_local(), b.grad.to_local())
                           for a, b in zip(eager.parameters(), ours.parameters())),
        "collectives": (facts["eager"][0], facts["remat"][0]),
        "peak_bytes": (facts["eager"][1], facts["remat"][1]),
        "graphs": [(s.budget_bytes, s.evaluation.peak_bytes, s.baseline_peak_bytes,
                    len(s.evaluation.recomputed_ids)) for s in steps],
        "step": (backend.ledger.budget_bytes, backend.ledger.predicted_step_bytes,
                 [(c.graph, c.outside_bytes + c.peak_bytes) for c in backend.ledger.last_step]),
        "no_remat_step_bytes": backend.ledger.no_remat_step_bytes,
        "sharded_bytes": sum(p.to_local().untyped_storage().nbytes() for p in ours.parameters()),
        "first_call_outside_bytes": backend.ledger.last_step[0].outside_bytes,
        "layer_unsharded_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
        "layer_graph_source_bytes": sum(n.out_bytes for n in problem.nodes
                                        if n.phase.name in ("PARAM", "INPUT")),
        "decisions": [tuple(d.value for d in s.plan.decisions.values()) for s in steps],
    }


def fsdp2_mixed_precision() -> dict[str, Any]:
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): recompute everything it may, in
    bf16, and the sharded fp32 gradients equal eager FSDP2's on the code path dynamo
    traces (transformers' compile path: eager run with torch.compiler.is_compiling() set;
    on eager's own path bf16 rounds differently, 1.2e-4 measured, with or without remat)."""
    from torch._export.utils import _compiling_state_context
    from torch.distributed.fsdp import MixedPrecisionPolicy

    rank = dist.get_rank()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = qwen2(layers=2)
    reference = _shard(copy.deepcopy(base), mp_policy=policy)
    ours = _shard(base, mp_policy=policy)
    backend = remat.backend(budget="100%", solver="all", compiler="eager")
    run = torch.compile(ours, backend=backend)
    run(**rank_batch(rank, 0)).loss.backward()
    with _compiling_state_context():
        reference(**rank_batch(rank, 0)).loss.backward()
    grads_equal = all(torch.equal(a.grad.to_local(), b.grad.to_local())
                      for a, b in zip(ours.parameters(), reference.parameters()))
    # a second step, measured: bf16 all-gathers, fp32 reduce-scatters and sharded grads
    batch = rank_batch(rank, 1)
    census = _census_bytes(ours, batch)
    _, rise = _profiled(lambda: run(**batch).loss.backward())
    recomputed_dtypes = set()
    for s in backend.steps:
        names = {s.graph_problem.value_name[i] for i in s.evaluation.recomputed_ids}
        recomputed_dtypes |= {str(n.meta["val"].dtype) for n in s.backward.graph.nodes
                              if n.name in names and isinstance(n.meta.get("val"), torch.Tensor)}
    return {
        "grads_equal": grads_equal,
        "grad_dtypes": sorted({str(p.grad.dtype) for p in ours.parameters()}),
        "recomputed_dtypes": sorted(recomputed_dtypes),
        "step": (census + rise, backend.ledger.predicted_step_bytes, backend.ledger.budget_bytes),
    }


def _steps_side_by_side(ours: Callable[..., Any], theirs: Callable[..., Any], models: tuple[nn.Module, ...],
                        rank: int, steps: int = 2) -> None:
    """`steps` training steps of `ours` and `theirs` on this rank's batches, each from
    cleared gradients of `models`."""
    for step in range(steps):
        for model in models:
            model.zero_grad(set_to_none=True)
        ours(**rank_batch(rank, step)).loss.backward()
        theirs(**rank_batch(rank, step)).loss.backward()


def fsdp2_inductor_percentage() -> dict[str, Any]:
    """torch.compile(fully_shard-ed Qwen2, backend=remat.backend(budget="90%")) with
    inductor: a percentage of the whole step's no-remat peak under inductor, two steps,
    gradients against eager FSDP2 (inductor rounds differently: relative 1e-4). (This
    narrow Qwen2 is mostly parameters: its step's floor is some 80% of its no-remat peak.)"""
    torch._dynamo.reset()  # what the scenarios before compiled
    rank = dist.get_rank()
    base = qwen2(layers=2)
    eager, ours = _shard(copy.deepcopy(base)), _shard(base)
    backend = remat.backend(budget="90%", solver="chen-greedy")
    _steps_side_by_side(torch.compile(ours, backend=backend), eager, (eager, ours), rank)
    close = all(torch.allclose(a.grad.to_local(), b.grad.to_local(), rtol=1e-4, atol=1e-6)
                for a, b in zip(eager.parameters(), ours.parameters()))
    return {
        "grads_close": close,
        "step": (backend.ledger.budget_bytes, backend.ledger.no_remat_step_bytes,
                 backend.ledger.predicted_step_bytes),
        "margins_known": all(s.no_remat_margin_bytes is not None for s in backend.steps),
        "calls": len(backend.ledger.last_step),
    }


def ddp_inductor_percentage() -> dict[str, Any]:
    """torch.compile(DDP(Qwen2), backend=remat.backend(budget="90%")) with inductor:
    DDPOptimizer's bucket graphs share one percentage of the whole step's no-remat peak
    under inductor, two steps, gradients against eager DDP (inductor rounds differently:
    relative 1e-4)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()  # what the scenarios before compiled
    rank = dist.get_rank()
    base = qwen2(hidden=128)
    reference = copy.deepcopy(base)
    backend = remat.backend(budget="90%", solver="chen-greedy")
    _steps_side_by_side(torch.compile(DDP(base, bucket_cap_mb=1), backend=backend), DDP(reference, bucket_cap_mb=1),
                        (base, reference), rank)
    close = all(torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
                for a, b in zip(reference.parameters(), base.parameters()))
    return {
        "grads_close": close,
        "step": (backend.ledger.budget_bytes, backend.ledger.no_remat_step_bytes,
                 backend.ledger.predicted_step_bytes),
        "margins_known": all(s.no_remat_margin_bytes is not None for s in backend.steps),
        "graphs": len({c.graph for c in backend.ledger.last_step}),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": ddp_grads_equal,
    "agree": plans_agree,
    "funcol": collectives_never_recomputed,
    "fsdp2_plan": fsdp2_plan_refused,
    "fsdp2_compile": fsdp2_compiled,
    "fsdp2_bf16": fsdp2_mixed_precision,
    "ddp_compile": ddp_compiled,
    "fsdp2_percentage": fsdp2_inductor_percentage,
    "ddp_percentage": ddp_inductor_percentage,
}


def worker(rank: int, port: int, out_dir: str, names: tuple[str, ...]) -> None:
    """One rank: run every scenario, pickle {name: facts or the traceback}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    results: dict[str, Any] = {}
    try:
        for name in names:
            try:
                results[name] = SCENARIOS[name]()
            except Exception:  # reported per scenario; the other ranks see it too
                results[name] = {"traceback": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
        dist.destroy_process_group()
