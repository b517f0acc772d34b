"""Train a 4-layer Qwen2 with FSDP2 (`fully_shard` on every layer and the root) on 2 CPU
processes (gloo), with remat as the `torch.compile` backend, and print each rank's
measured peak against the same FSDP2 step without remat.

    HF_HUB_OFFLINE=1 python examples/fsdp2_train.py [--budget 70%] [--steps 3]

Composition: shard first, then `torch.compile(model, backend=remat.backend(...))`.
(`remat.plan` over a sharded model is refused: see `remat.planning.distributed`.) Dynamo splits
the step at every FSDP2 module (its all-gathers and reduce-scatters run in eager hooks,
between the graphs, never inside a plan): here 3 graphs, the layer graph serving all 4
layers. The budget is the whole step's (`remat.runtime.step.ledger`): each graph call is
planned under the budget minus what is live outside it when it runs (earlier layers'
saved activations, tensors crossing graphs, the other graphs' parameters and gradients,
and FSDP2's own memory: sharded parameters and gradients, the unsharded parameters of
the other groups, all-gather and reduce-scatter buffers; `remat.runtime.step.fsdp`), and
a percentage is of the whole step's no-remat peak. A layer graph's inputs include the
layer's unsharded parameters, live from its all-gather to its reshard, so the plan counts
them. The measured peak counts what is live before the step (sharded parameters, the
batch) plus the profiler's rise, and stays under the ledger's prediction.
Every rank runs rank 0's plans. The peak is measured with the profiler's allocator
events (dispatch modes would make dynamo fall back to eager).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import remat  # noqa: E402
from remat.budget import format_bytes  # noqa: E402
from remat.testing.measure import measure_step_profiler  # noqa: E402

WORLD = 2


def build_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         use_cache=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).train()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, 256, (8, 64), generator=gen)
    return {"input_ids": ids, "labels": ids}


def train(rank: int, port: int, budget: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = build_model()
    plain, compiled, ours = shard(copy.deepcopy(model)), shard(copy.deepcopy(model)), shard(model)
    backend = remat.backend(budget=budget, solver="chen-greedy", compiler="eager")
    # The same step compiled without remat separates AOTAutograd's own saving from remat's.
    modules = {"fsdp2": plain, "compiled": compiled, "fsdp2+remat": ours}
    runs = {"fsdp2": plain, "compiled": torch.compile(compiled, backend="aot_eager"),
            "fsdp2+remat": torch.compile(ours, backend=backend)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-2) for name, m in modules.items()}
    peaks: dict[str, int] = {}
    for name, run in runs.items():
        for step in range(steps):
            tokens = batch(rank, step)

            def one_step(tokens: dict[str, torch.Tensor] = tokens) -> None:
                run(**tokens).loss.backward()
            if step == 0:
                one_step()  # the first step compiles: its peak is the compiler's
            else:
                # live before the step: the sharded parameters (DTensors: their local
                # shards) and the batch; gradients were set to None by zero_grad
                live = [p.to_local().detach() for p in modules[name].parameters()] + list(tokens.values())
                peak = measure_step_profiler(one_step, register=live).peak_bytes
                peaks[name] = max(peaks.get(name, 0), peak)
            optimizers[name].step()
            optimizers[name].zero_grad()
    # Dynamo runs transformers' compile path (an explicit causal mask instead of
    # is_causal=True), equal to eager's up to rounding; remat itself is bit-exact there.
    drift = max((a.to_local() - b.to_local()).abs().max().item()
                for a, b in zip(plain.parameters(), ours.parameters()))
    lines = [f"rank {rank}: peak {format_bytes(peaks['fsdp2+remat'])} with remat, "
             f"{format_bytes(peaks['fsdp2'])} eager FSDP2 "
             f"({peaks['fsdp2+remat'] / peaks['fsdp2']:.0%}), "
             f"{format_bytes(peaks['compiled'])} compiled without remat "
             f"({peaks['fsdp2+remat'] / peaks['compiled']:.0%}); "
             f"{len(backend.steps)} graphs planned; weights after {steps} steps differ from "
             f"plain FSDP2's by at most {drift:.1e}",
             f"rank {rank}: measured {peaks['fsdp2+remat']:,} B <= predicted "
             f"{backend.ledger.predicted_step_bytes:,} B <= budget {backend.ledger.budget_bytes:,} B "
             f"(the whole step's, FSDP2's sharded state and buffers counted)"]
    if rank == 0:
        lines.append(backend.ledger.describe())
        for k, planned in enumerate(backend.steps):
            lines.append(f"  graph {k}: no-remat peak {format_bytes(planned.baseline_peak_bytes)}, "
                         f"planned {format_bytes(planned.evaluation.peak_bytes)} (its share when "
                         f"planned: {format_bytes(planned.budget_bytes)}), "
                         f"{len(planned.evaluation.recomputed_ids)} values recomputed")
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help="the whole step's: bytes, '800MB', or a "
                        "percentage of the whole step's no-remat peak")
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(port, opts.budget, opts.steps), nprocs=WORLD)


if __name__ == "__main__":
    main()
