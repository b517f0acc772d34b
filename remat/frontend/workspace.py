"""Measure each op's workspace: the bytes it allocates and frees inside itself, beyond
its outputs (CPU im2col and oneDNN scratch, cuDNN/cuBLAS workspaces), which no tensor
ever holds but the allocator serves (`max_memory_allocated` counts it).

Each distinct (op, argument shapes/strides/dtypes, device, other arguments) runs once on
fresh tensors of the traced shapes, inside one profiler session with
`profile_memory=True`; its workspace is the peak of the running sum of allocator events
inside the op less what is still allocated when it returns (its outputs). Results are
cached for the process. Never run: collectives (c10d namespaces: they would need the
other ranks), remat's and torch's offload ops, and ops whose arguments cannot be made
(sizes without a hint). Measuring runs under a forked RNG state, so the user's random
stream is untouched. On meta/fake planning nothing runs: every workspace is 0, stated
as the assumption (`GraphProblem` callers log it).

Measuring allocates real memory, and it may run inside a training step (a planned
module called with a new input shape plans that shape first). So an op runs only when
its fresh arguments and outputs fit under `limit_bytes` (what the budget leaves beside
the values live at the call), and nothing runs while a profiler records (a second
profiler session would end the user's). An op not run takes its workspace from the cache
at this shape, else `bounded`: the largest measured for the same op at any shape, scaled
by how much larger this call's arguments are (0 for an op never measured).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx
from torch.profiler import ProfilerActivity, profile, record_function

from remat import compat
from remat.compat import OpOverload
from remat.frontend.profile import made_at_run, tensor_val
from remat_solvers import Phase, Problem

log = logging.getLogger(__name__)

NEVER_RUN_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor",
                                  "remat", "ao"})
"""Op namespaces measuring must never execute (collectives; remat's and torch's offload ops)."""

_CACHE: dict[tuple, int] = {}


def _namespace(target: Any) -> str:
    return getattr(target, "namespace", "") or str(target).split(".", 1)[0]


def size_hint(value: Any) -> Any:
    """A size by its hint, without guarding on it (int() on a SymInt would specialize
    the graph on this size)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = getattr(value.node, "hint", None)
        if hint is None:
            raise ValueError(f"symbolic value {value} has no hint")
        return hint
    return value


def _describe(value: Any) -> Any:
    """A hashable description of one argument (tensors by layout, not content)."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ("T", tuple(size_hint(s) for s in value.shape), tuple(size_hint(s) for s in value.stride()),
                value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", type(value).__name__, size_hint(value))
    return ("V", repr(value))


def op_key(node: fx.Node) -> tuple | None:
    """The cache key of a node's op, or None when it is not measured."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return None
    if _namespace(target) in NEVER_RUN_NAMESPACES:
        return None
    try:
        return (str(target), _describe(list(node.args)), _describe(sorted(node.kwargs.items())))
    except (TypeError, ValueError, RuntimeError):  # a size without a hint
        return None


def _materialize(value: Any) -> Any:
    """Real arguments for one measured call: fresh tensors of the traced layout (normal
    floats, zero integers so indices stay in range), sizes resolved by their hints."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        shape = tuple(size_hint(s) for s in value.shape)
        stride = tuple(size_hint(s) for s in value.stride())
        # filled through its storage: an expanded layout (stride 0) cannot be written
        # element-wise (LLaMA's attention mask is one)
        span = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        base = torch.empty(span, dtype=value.dtype, device=value.device)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            base.normal_()
        else:
            base.zero_()
        return base.as_strided(shape, stride)
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    if isinstance(value, dict):  # keyword arguments (an attention mask, say)
        return {k: _materialize(v) for k, v in value.items()}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(value)
    return value


def measure(nodes: Iterable[fx.Node], device: torch.device, *, limit_bytes: int | None = None
            ) -> dict[str, int]:
    """Workspace bytes per node name (nodes not measured are absent). With `limit_bytes`,
    an op whose fresh arguments and outputs take more is not run (`bounded`)."""
    from remat.compat import unset_fake_temporarily  # on use: only measuring workspace needs it

    out: dict[str, int] = {}
    todo: dict[tuple, fx.Node] = {}
    keyed: list[tuple[str, tuple]] = []
    # CPU kernels may size their scratch by the intra-op thread count: measured,
    # native_layer_norm_backward on (512, 256) allocates 2,048 B on 1 thread, 4,096 on 2
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    for node in nodes:
        key = op_key(node)
        if key is not None and _reads_made_at_run(node, device):
            out[node.name] = unmeasured_attention_bytes(node)
            continue
        if key is None:
            continue
        key = (*key, threads)
        keyed.append((node.name, key))
        if key not in _CACHE:
            todo.setdefault(key, node)
    recording = profiler_recording()
    runnable = {key: node for key, node in todo.items()
                if not recording and (limit_bytes is None or footprint_bytes(node) <= limit_bytes)}
    if runnable:
        with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []):
            _CACHE.update(_run(list(runnable.items()), device))
    if len(runnable) < len(todo):
        log.info("workspace: %d ops not run (%s); their workspace is bounded from other shapes",
                 len(todo) - len(runnable), "a profiler is recording" if recording else "over the limit")
    for name, key in keyed:
        found = _CACHE.get(key) if key in _CACHE else bounded(key, todo[key])
        if found:
            out[name] = found
    return out


def profiler_recording() -> bool:
    """Whether a torch profiler session is recording in this process."""
    return compat.profiler_enabled()


def footprint_bytes(node: fx.Node) -> int:
    """Bytes measuring `node` allocates besides its workspace: fresh arguments and its
    outputs, at their traced sizes."""
    args = [tensor_val(a) for a in node.all_input_nodes]
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return sum(_span_bytes(t) for t in (*args, *outs) if isinstance(t, torch.Tensor))


def _span_bytes(t: torch.Tensor) -> int:
    shape = [size_hint(n) for n in t.shape]
    if 0 in shape:
        return 0
    span = 1 + sum((n - 1) * size_hint(st) for n, st in zip(shape, t.stride()))
    return span * t.element_size()


def bounded(key: tuple, node: fx.Node) -> int:
    """Workspace of an op not run at this shape: from each shape the same op was measured
    at, its workspace scaled up by how many times larger this call's arguments are
    (workspaces grow with their operands, and never shrink here); the largest of them."""
    this = _key_bytes(key)
    return max((int(ws * max(1.0, this / max(1, _key_bytes(k))) + 0.5)
                for k, ws in _CACHE.items() if k[0] == key[0] and k[-1] == key[-1]), default=0)


def _key_bytes(key: tuple) -> int:
    """Bytes of the tensor arguments a cache key describes."""
    total, stack = 0, [key[1], key[2]]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple) and item and item[0] == "T":
            _, shape, stride, dtype, _ = item
            if 0 not in shape:
                total += (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * dtype.itemsize
        elif isinstance(item, tuple):
            stack.extend(item)
    return total


def _reads_made_at_run(node: fx.Node, device: torch.device) -> bool:
    """Whether an argument of `node` is a value whose device the trace does not know
    (SDPA's Philox seed and offset, `frontend.profile.made_at_run`): a fresh stand-in on
    the traced device is not what the kernel reads (a CUDA seed is dereferenced on the
    host: a segmentation fault), so the op is not run (`unmeasured_attention_bytes`)."""
    return any(made_at_run(a, device.type) for a in node.all_input_nodes)


def unmeasured_attention_bytes(node: fx.Node) -> int:
    """Workspace of an op reading a fused attention kernel's Philox state, which cannot
    run on stand-ins (`_reads_made_at_run`): taken as its outputs' bytes again in fp32
    (a float accumulator per gradient, as the memory-efficient kernel's backward keeps
    for its query gradient), so the plan errs above the allocator, never below."""
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return sum(_span_bytes(t) // t.element_size() * 4 for t in outs
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _run(todo: list[tuple[tuple, fx.Node]], device: torch.device) -> dict[tuple, int]:
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    ran: dict[str, tuple] = {}
    with profile(activities=activities, profile_memory=True) as prof:
        for k, (key, node) in enumerate(todo):
            try:
                args, kwargs = _materialize(list(node.args)), _materialize(dict(node.kwargs))
            except (TypeError, ValueError, RuntimeError) as err:
                log.debug("workspace: cannot build arguments of %s: %s", node.format_node(), err)
                continue
            label = f"remat.workspace.{k}"
            try:
                with record_function(label):
                    result = node.target(*args, **kwargs)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
            except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as err:
                log.debug("workspace: %s failed on fresh inputs (%s); assuming none", node.format_node(), err)
                continue
            ran[label] = key
            del result, args, kwargs
    found = {key: 0 for key, _ in todo}
    found.update(_workspaces(prof, device, ran))
    return found


def _workspaces(prof: Any, device: torch.device, ran: dict[str, tuple]) -> dict[tuple, int]:
    """Per labelled call: peak of its allocator events' running sum less their final sum."""
    out: dict[tuple, int] = {}
    stack = compat.profiler_event_tree(prof)
    while stack:
        event = stack.pop()
        key = ran.get(event.name)
        if key is None:
            stack.extend(event.children)
            continue
        sizes = []
        inner = [event]
        while inner:
            e = inner.pop()
            size = getattr(e.extra_fields, "alloc_size", None)
            if size is not None and e.extra_fields.device.type == device.type:
                sizes.append((e.start_time_ns, len(sizes), int(size)))
            inner.extend(e.children)
        running = high = 0
        for _, _, size in sorted(sizes):
            running += size
            high = max(high, running)
        out[key] = max(0, high - running)
    return out


def joint_device(joint: fx.GraphModule) -> torch.device | None:
    """The device of the joint graph's tensors (the first one found), or None."""
    for node in joint.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


_STEP_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("remat_step_budget", default=None)


@contextlib.contextmanager
def inside_a_step(budget_bytes: int) -> Iterator[None]:
    """Planning inside a training step under `budget_bytes` (a planned module's new input
    shape): measuring stays under the budget beside the step's inputs and parameters
    (`measure`'s `limit_bytes`)."""
    token = _STEP_BUDGET.set(budget_bytes)
    try:
        yield
    finally:
        _STEP_BUDGET.reset(token)


def with_workspace(problem: Problem, fx_names: tuple[tuple[str, ...], ...],
                   joint: fx.GraphModule) -> Problem:
    """`problem` with each node's measured workspace (its op is fx_names[i][0]); inside a
    step (`inside_a_step`), within what its budget leaves."""
    budget_bytes = _STEP_BUDGET.get()
    device = joint_device(joint)
    if device is None or device.type == "meta":
        return problem
    by_name = {node.name: node for node in joint.graph.nodes}
    ops = [by_name[names[0]] for names in fx_names if names and names[0] in by_name]
    limit = None
    if budget_bytes is not None:
        live = sum(n.out_bytes for n in problem.nodes
                   if n.phase in (Phase.PARAM, Phase.INPUT) and n.alias_of is None)
        limit = budget_bytes - live
    found = measure(ops, device, limit_bytes=limit)
    if not found:
        return problem
    extra = _outputs_made_early(problem, fx_names, by_name)
    nodes = tuple(
        dataclasses.replace(node, workspace_bytes=found.get(names[0], 0) + extra.get(i, 0)) if names else node
        for i, (node, names) in enumerate(zip(problem.nodes, fx_names))
    )
    log.info("workspace: %d ops allocate transient bytes (largest %d B)", len(found), max(found.values()))
    return dataclasses.replace(problem, nodes=nodes)


def _outputs_made_early(problem: Problem, fx_names: tuple[tuple[str, ...], ...],
                        by_name: dict[str, fx.Node]) -> dict[int, int]:
    """Per problem id of a multi-output op (fx_names (op, first getitem)): the bytes of its
    other outputs. The op allocates them all while it runs, next to its workspace, but the
    problem makes each other output at its own (later) step; so they count as transient
    bytes at the op's step. Measured on a ResNet's convolution_backward: grad_weight is
    allocated before the scratch, so a prediction that left it out would sit 36,256 B
    under the allocator's peak there."""
    id_of = {names[-1]: i for i, names in enumerate(fx_names) if names}
    out: dict[int, int] = {}
    for i, names in enumerate(fx_names):
        if len(names) != 2 or names[0] not in by_name:
            continue
        others = [id_of[u.name] for u in by_name[names[0]].users
                  if u.name != names[1] and u.name in id_of]
        extra = sum(problem.nodes[j].out_bytes for j in others if problem.nodes[j].alias_of is None)
        if extra:
            out[i] = extra
    return out
