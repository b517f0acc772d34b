"""Per-node cost model: FLOPs and bytes moved of one ATen op, and a roofline time.

FLOPs follow `torch.utils.flop_counter` (only matmul-like ops count; elementwise ops
are 0 FLOPs and costed by the bytes they move), plus formulas for what it misses in
torch 2.13: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the
kernels CPU SDPA dispatches to). `flop_counter_mode()` gives a `FlopCounterMode` that
knows those formulas too, so measured and modelled FLOPs agree; `FlopCounter` counts the
same without FlopCounterMode's module tracker (which breaks on AOTAutograd's runtime).

Time: ``max(flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s)`` with the
device's figures from a sub-second microbenchmark, cached as JSON under
``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``), keyed by device name, thread count,
dtype and torch version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten, tree_map

from remat import compat
from remat.compat import DispatchKey, OpOverload, TorchDispatchMode
from remat.errors import RematError

# The private torch names only some costs need come from remat.compat inside the functions
# that use them: a torch without one fails only that cost, not remat (remat.compat).

log = logging.getLogger(__name__)

CACHE_ENV = "REMAT_CACHE_DIR"
CACHE_FILE = "device_speed.v2.json"
"""v2 keeps v1 files out: they may hold figures timed under AOTAutograd's FakeTensorMode
(fake ops, about 200x too fast); `device_speed` always measures real kernels."""


# --- FLOPs -----------------------------------------------------------------------------


def sdpa_flop_count(query_shape, key_shape, value_shape) -> int:
    """FLOPs of scaled dot-product attention's two matmuls, grouped-query attention
    included (key and value with fewer heads, broadcast to the query's); causal masking
    is not discounted, as in torch's formulas. remat's own, so that every supported torch
    counts alike (torch 2.11's formula rejects grouped-query shapes)."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (d_q + d_v)


def sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """FLOPs of attention's backward: the scores again (q k^T), then the gradients of
    v, of the scores, of q and of k (one matmul each), grouped-query attention included."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (3 * d_q + 2 * d_v)


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                        **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_SDPA_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _extra_formulas() -> dict[Any, Any]:
    """Formulas keyed by OpOverloadPacket: attention's fused kernels, forward and
    backward, on every device (torch has no formula for the CPU kernel, and its CUDA
    ones differ between versions)."""
    aten = torch.ops.aten
    extra: dict[Any, Any] = {}
    for kernel in _SDPA_KERNELS:
        for name, formula in ((kernel, _sdpa_flop), (f"{kernel}_backward", _sdpa_backward_flop)):
            packet = getattr(aten, name, None)
            if packet is not None:
                extra[packet] = formula
    return extra


EXTRA_FLOP_FORMULAS: dict[Any, Any] = _extra_formulas()
"""Raw (shape-taking) formulas, usable as ``FlopCounterMode(custom_mapping=...)``."""

_REGISTRY: dict[Any, Any] = {
    **flop_counter.flop_registry,
    **{k: flop_counter.shape_wrapper(v) for k, v in EXTRA_FLOP_FORMULAS.items()},
}


def flop_counter_mode(**kwargs: Any) -> flop_counter.FlopCounterMode:
    """A quiet `FlopCounterMode` that also counts CPU flash attention."""
    kwargs.setdefault("display", False)
    return flop_counter.FlopCounterMode(custom_mapping=dict(EXTRA_FLOP_FORMULAS), **kwargs)


class FlopCounter(TorchDispatchMode):
    """Count FLOPs of everything run inside it, like `FlopCounterMode` (same formulas,
    composite ops decomposed the same way, CPU flash attention included) but without its
    module tracker, whose hooks fail on fx GraphModules run inside an autograd.Function
    (AOTAutograd's runtime: "Expected gradient function to be set").

        with FlopCounter() as counter:
            step()
        counter.total_flops
    """

    def __init__(self) -> None:
        super().__init__()
        self.total_flops = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = _REGISTRY.get(func.overloadpacket)
        if formula is None and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            flops = _as_int(formula(*args, **kwargs, out_val=out))
            self.total_flops += flops
            name = str(func.overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + flops
        return out


def _as_int(value: Any) -> int:
    """An int from an int or a SymInt: its hint (the example size dynamo compiled with),
    which installs no guard (`remat.compat.optimization_hint`); `int(sym)` would
    specialize the graph to the example."""
    if isinstance(value, torch.SymInt):
        return compat.optimization_hint(value, fallback=4096)
    return int(value)


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _is_composite(target: OpOverload) -> bool:
    key = DispatchKey.CompositeImplicitAutograd
    return target.has_kernel_for_dispatch_key(key)


def _decomposed_flops(target: OpOverload, args: Any, kwargs: Any) -> int:
    """FLOPs of a composite op (``aten.linear``, ``aten.matmul``...) by running its
    decomposition on the fake values under a FlopCounterMode."""
    from remat.compat import detect_fake_mode

    fake_mode = detect_fake_mode(tree_flatten((args, kwargs))[0])
    counter = flop_counter_mode()
    if fake_mode is None:
        with counter:
            target.decompose(*args, **kwargs)
    else:
        with fake_mode, counter:
            target.decompose(*args, **kwargs)
    return _as_int(counter.get_total_flops())


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one ``call_function`` node of an ATen graph (0 for anything else).

    Reads only ``meta["val"]`` of the node and its inputs; runs nothing except for
    composite ops missing from the registry, whose decomposition runs on fake tensors.
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return 0
    args, kwargs = tree_map(_val, (node.args, node.kwargs))
    formula = _REGISTRY.get(target.overloadpacket)
    if formula is not None:
        return _as_int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    if _is_composite(target):
        return _decomposed_flops(target, args, kwargs)
    return 0


# --- Bytes -----------------------------------------------------------------------------


def _tensor_bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return _as_int(value.numel()) * value.element_size()


def _is_view(target: OpOverload) -> bool:
    """True when every output aliases an input without writing it (no data moves)."""
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def node_bytes_moved(node: torch.fx.Node) -> int:
    """Bytes read (tensor inputs) plus bytes written (tensor outputs) by one node;
    0 for views and for non-op nodes (placeholders, getitem, output)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return 0
    if _is_view(target):
        return 0
    read = sum(_tensor_bytes(v) for v in tree_flatten(tree_map(_val, (node.args, node.kwargs)))[0])
    written = sum(_tensor_bytes(v) for v in tree_flatten(node.meta.get("val"))[0])
    return read + written


# --- Device speed ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpeed:
    """Roofline figures of one device."""

    peak_flops_per_s: float
    """Sustained matmul throughput (FLOP/s) for the measured dtype."""
    bandwidth_bytes_per_s: float
    """Sustained memory bandwidth, bytes read plus written per second (a large copy)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_s", "bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0.0 or value == float("inf"):
                raise ValueError(f"DeviceSpeed.{name} must be a positive finite number, got {value!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_device_speed(
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
    matmul_n: int = 1024,
    copy_bytes: int = 64 * 2**20,
    repeats: int = 3,
) -> DeviceSpeed:
    """Microbenchmark: an ``n x n`` matmul for FLOP/s, a large copy for bandwidth (best
    of `repeats`). About 0.3 s on a 2-core CPU with the defaults."""
    device = torch.device(device)
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    out = torch.empty(matmul_n, matmul_n, device=device, dtype=dtype)
    matmul_s = _best_s(lambda: torch.mm(a, b, out=out), device, repeats)
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_s(lambda: dst.copy_(src), device, repeats)
    return DeviceSpeed(
        peak_flops_per_s=2.0 * matmul_n**3 / matmul_s,
        bandwidth_bytes_per_s=2.0 * src.numel() * src.element_size() / copy_s,
    )


def cache_dir() -> Path:
    """Where cached figures live: ``$REMAT_CACHE_DIR`` or ``~/.cache/remat``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "remat"


def device_key(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Cache key: device name, threads (CPU), dtype, torch version."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type}:{platform.machine()}:{_cpu_model()}:threads={torch.get_num_threads()}"
    return f"{name}|{dtype}|torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_speed(
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
    refresh: bool = False,
) -> DeviceSpeed:
    """The device's figures, measured once and cached (``refresh=True`` re-measures)."""
    path = cache_dir() / CACHE_FILE
    key = device_key(device, dtype)
    table = _read_cache(path)
    if not refresh and key in table:
        try:
            return DeviceSpeed(**table[key])
        except (TypeError, ValueError) as err:
            log.warning("ignoring bad cache entry %r in %s: %s", key, path, err)
    speed = _measure_real(device, dtype)
    table[key] = dataclasses.asdict(speed)
    _write_cache(path, table)
    log.info("measured %s: %.3g FLOP/s, %.3g B/s (cached in %s)", key,
             speed.peak_flops_per_s, speed.bandwidth_bytes_per_s, path)
    return speed


def speed_on(device: torch.device | None) -> DeviceSpeed:
    """The figures a graph on `device` is priced with: a GPU's own, measured on it once
    per GPU model, dtype and torch (recomputing costs what that GPU spends, not what
    the host would); this CPU's for anything else."""
    return device_speed(device if device is not None and device.type == "cuda" else "cpu")


def _measure_real(device: str | torch.device, dtype: torch.dtype) -> DeviceSpeed:
    """Measure with real tensors even when called while AOTAutograd or inductor trace
    (under FakeTensorMode and proxy modes, a microbenchmark would time fake ops)."""
    from remat.compat import disable_current_modes, unset_fake_temporarily

    with unset_fake_temporarily(), disable_current_modes():
        return measure_device_speed(device, dtype=dtype)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as err:
        log.warning("ignoring unreadable cache %s: %s", path, err)
        return {}
    return table if isinstance(table, dict) else {}


def _write_cache(path: Path, table: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # atomic: concurrent writers never leave a torn file
    except OSError as err:
        log.warning("could not write cache %s (%s); set %s to a writable folder", path, err, CACHE_ENV)


# --- Time ------------------------------------------------------------------------------


def estimate_s(flops: float, bytes_moved: float, speed: DeviceSpeed) -> float:
    """Roofline time: the op is bound by compute or by memory traffic, whichever is slower."""
    return max(flops / speed.peak_flops_per_s, bytes_moved / speed.bandwidth_bytes_per_s)


def node_cost_s(node: torch.fx.Node, speed: DeviceSpeed) -> float:
    """Estimated seconds to run one node once."""
    return estimate_s(node_flops(node), node_bytes_moved(node), speed)


# --- Cost models -----------------------------------------------------------------------

COST_MODELS = ("eager", "compiled", "compiled-traffic")
"""How a node's time is estimated (`PlannerSettings.cost_model`, from `remat.plan`/`remat.backend`):

- ``"eager"``: every op runs as its own kernel: the roofline of its FLOPs and of all the
  bytes it reads and writes. Right for `remat.plan` and `compiler="eager"`.
- ``"compiled"``: the graphs run under inductor, which fuses pointwise ops into one kernel
  with their consumers. A pointwise op (ATen's ``pointwise`` tag) then never writes its
  result and reads from memory only the inputs a fused chain cannot keep in registers: the
  outputs of non-pointwise ops (matmuls, reductions, placeholders). So its cost is those
  input bytes over the bandwidth, and recomputing a GELU or a dropout-free residual chain
  costs memory traffic, not a kernel. A pointwise value that a kernel which cannot fuse
  it reads (a matmul, attention, a convolution; through views) is written out, recomputed
  or not, and costs its bytes once more: without that charge, LLaMA's bench plan at
  100% put 4.7 ms of pointwise kernels into the backward that the model priced near 0
  (its backward ran 2% slower than torch.compile's; with it, 0.9%). Matmuls,
  convolutions, reductions and extern kernels keep the eager roofline. Saving a fusible
  value costs traffic that recomputing it does not; under this model that enters after
  the solver, through a greedy pass (`remat.planning.fused_recompute`).
- ``"compiled-traffic"``: the same recompute costs, and the traffic of saving in the
  objective itself: a saved pointwise value that the backward reads costs 2 x its bytes
  over the bandwidth (written in the forward, read back in the backward; recomputed, it
  is fused into its readers and never written), `remat_solvers.Node.save_s`. Every solver's
  objective and `simulate`'s cost then include it; `dp`/`layers` decline such problems
  (their tables count recompute seconds only), so `auto` uses `ilp`. The default of
  `remat.backend` (inductor): at torch.compile's 0.5 point its plans ran GPT-2 tiny's
  step (dropout on) at 0.96-1.00x torch.compile's against 1.08x under "compiled", and
  LLaMA tiny's at 1.06-1.09x against 1.08x (bench/compiled_pairs.py, bench/README.md).

Under inductor both compiled models also price inductor's random draws as measured on
this machine (`remat.frontend.inductor_random`): per element, not as traffic, and once
more for a dropout mask saved straight from a draw.
"""


def is_pointwise(node: torch.fx.Node) -> bool:
    """Whether `node` runs an ATen op tagged pointwise (inductor fuses it into its readers)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, OpOverload)
            and torch.Tag.pointwise in target.tags)


def compiled_node_cost_s(node: torch.fx.Node, speed: DeviceSpeed,
                         random_s_per_element: float | None = None) -> float:
    """Seconds for one node when inductor fuses pointwise chains (see `COST_MODELS`).
    `random_s_per_element`: what one of inductor's random draws costs
    (`remat.frontend.inductor_random`); an `inductor_random` node then costs its
    elements times it, not its traffic (on CPU 40x more)."""
    if random_s_per_element is not None:
        from remat.frontend.inductor_random import is_inductor_random  # a cycle: it imports costs

        if is_inductor_random(node) and isinstance(_val(node), torch.Tensor):
            return max(node_cost_s(node, speed), _val(node).numel() * random_s_per_element)
    if not is_pointwise(node):
        return node_cost_s(node, speed)
    read = sum(
        _tensor_bytes(_val(arg)) for arg in node.all_input_nodes if not is_pointwise(arg)
    )
    if _read_unfused(node):
        read += _tensor_bytes(_val(node))
    return read / speed.bandwidth_bytes_per_s


def _read_unfused(node: torch.fx.Node) -> bool:
    """Whether a kernel that cannot fuse a pointwise producer reads `node`'s value (through
    views): a matmul, attention, a convolution (anything neither pointwise nor a
    reduction). Inductor then writes the value out, recomputed or not."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        target = user.target
        if not isinstance(target, OpOverload):
            return True
        if _is_view(target):
            stack.extend(user.users)
        elif not fuses_pointwise_inputs(user):
            return True
    return False


def fuses_pointwise_inputs(node: torch.fx.Node) -> bool:
    """Whether inductor computes a pointwise producer inside `node`'s kernel: `node` runs
    an ATen op tagged pointwise or reduction."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, OpOverload)
            and (torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags))


def save_cost_s(node: torch.fx.Node, speed: DeviceSpeed, random_s_per_element: float | None = None) -> float:
    """Seconds that saving `node`'s value costs under "compiled-traffic" (see
    `COST_MODELS`): 2 x its bytes over the bandwidth when it is pointwise, else 0 (a
    matmul's or reduction's output is written whether it is saved or not).
    `random_s_per_element`: a dropout mask stored straight from inductor's random draw
    also costs its draw once more (`remat.frontend.inductor_random.is_stored_mask`)."""
    if not is_pointwise(node):
        return 0.0
    traffic_s = 2.0 * _tensor_bytes(_val(node)) / speed.bandwidth_bytes_per_s
    if random_s_per_element is not None:
        from remat.frontend.inductor_random import is_stored_mask  # a cycle: it imports costs

        if is_stored_mask(node):
            return traffic_s + _val(node).numel() * random_s_per_element
    return traffic_s


def cost_function(cost_model: str, speed: DeviceSpeed, *, random_s_per_element: float | None = None):
    """`node -> seconds` of the named cost model (one of `COST_MODELS`);
    `random_s_per_element`: see `compiled_node_cost_s` (compiled models only)."""
    if cost_model == "eager":
        return lambda node: node_cost_s(node, speed)
    if cost_model in ("compiled", "compiled-traffic"):
        return lambda node: compiled_node_cost_s(node, speed, random_s_per_element)
    raise RematError(f"unknown cost_model={cost_model!r}; valid cost models: {list(COST_MODELS)}")
