"""What one random number that inductor's generated code draws costs on this machine,
measured once and cached next to the device figures (`costs.cache_dir()`).

Under inductor a dropout mask is `prims.inductor_random` (a seed and an offset per
element, functionalized so that a recomputation draws the same numbers), and on CPU
each element runs a Philox round of its own: measured 9.5-10 ns per element with one
thread on this project's 2-core machine, where a fused pointwise op moves its bytes in
0.23 ns per element. The "compiled" cost model prices a pointwise op by its memory
traffic; priced the same way, regenerating GPT-2 tiny's attention-dropout mask (131,072
elements) looked like 0.03 ms, and remat's plan at torch.compile's 0.5 point recomputed
masks worth 1.3 ms each: its step ran 9% slower than torch.compile's. So the compiled
models charge an `inductor_random` node its elements times this figure.

Saving the mask costs too. Inductor's C++ kernel that stores a comparison of a draw as a
bool tensor (`inductor_random(...) > p`, the dropout mask saved for the backward) runs
at half the draw's speed: 642 µs against 333 µs for 32,768 elements stored as floats,
the same single draw in the generated code (torch 2.13, GCC, one thread; measured here).
GPT-2 tiny's forward at torch.compile's 0.5 point took 10.9 ms under remat's plan, which
saves such masks, against 6.9 ms under torch.compile's; so under "compiled-traffic" a
saved mask of a draw is charged its draw once more (`costs.save_cost_s`).

The figure comes from one tiny graph (`inductor_random` of 2^17 elements) compiled by
inductor and timed (best of 20; about 2 s the first time on a machine, for the C++
build), keyed like the device figures (device, thread count, dtype, torch version).
"""

from __future__ import annotations

import logging
import time

import torch

from remat.frontend import costs

log = logging.getLogger(__name__)

CACHE_FILE = "inductor_random.v1.json"
ELEMENTS = 1 << 17
"""Elements of the measured draw: GPT-2 tiny's attention mask, large enough that the
kernel's fixed overhead (a few µs) is under 1% of its time."""


def is_inductor_random(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers in inductor's generated code."""
    target = getattr(node.target, "overloadpacket", node.target)
    return getattr(target, "__name__", "") in ("inductor_random", "inductor_randint")


def is_stored_mask(node: torch.fx.Node) -> bool:
    """Whether `node` is a bool tensor computed straight from one of inductor's random
    draws (a dropout mask): saved, its draw runs at half speed (module docstring)."""
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype == torch.bool
            and any(is_inductor_random(arg) for arg in node.all_input_nodes))


def random_s_per_element(device: str = "cpu", *, refresh: bool = False) -> float:
    """Seconds per element of `prims.inductor_random` on `device` (see the module
    docstring), measured once and cached (`refresh=True` measures again)."""
    path = costs.cache_dir() / CACHE_FILE
    key = costs.device_key(device)
    if not refresh and (path, key) in _READ:  # the backend asks twice per compile
        return _READ[path, key]
    table = costs._read_cache(path)
    value = table.get(key)
    if refresh or not isinstance(value, (int, float)) or value <= 0:
        value = _measure(device)
        table[key] = value
        costs._write_cache(path, table)
        log.info("measured inductor's random draws on %s: %.3g s per element (cached in %s)", key, value, path)
    _READ[path, key] = float(value)
    return float(value)


_READ: dict[tuple, float] = {}
"""Figures this process has read or measured, by (cache file, device key)."""


def _measure(device: str) -> float:
    """Compile the draw with inductor and time it, with real tensors and no trace of the
    caller's in force (this may run while a graph is being compiled)."""
    # inductor's compiler loads here, when the figure is first measured, not with remat
    from remat.compat import (
        compile_fx_inner,
        disable_current_modes,
        inductor_prims,  # noqa: F401  (registers prims.inductor_random)
        make_fx,
        tracing,
        unset_fake_temporarily,
    )

    def draw(seed: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.ops.prims.inductor_random.default([ELEMENTS], seed, "rand"),)

    with unset_fake_temporarily(), disable_current_modes(), tracing(None):
        seed = torch.tensor(1234, dtype=torch.int64, device=device)
        compiled = compile_fx_inner(make_fx(draw)(seed), [seed])
        compiled([seed])  # warm up
        best = float("inf")
        for _ in range(20):
            started = time.perf_counter()
            compiled([seed])
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
    return best / ELEMENTS


__all__ = ["CACHE_FILE", "is_inductor_random", "is_stored_mask", "random_s_per_element"]
