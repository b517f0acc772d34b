"""The walk over inductor's generated wrapper code (`V.graph.wrapper_code.lines`, read
before any kernel is compiled) that says what the code allocates and frees, and what it
returns (`remat.runtime.inductor.estimate` compares it with the same graph run op by op).

With an extern kernel's call holding all its outputs and its workspace until it
returns (`_in_call_bytes`), and `estimate` counting the saved inputs the forward copies
and lowering the backward on the strides the forward returns, the prediction equals the
profiler's measurement on GPT-2, BERT and ViT tiny, at 1 and 2 threads (LLaMA: 32 B of a
buffer no graph reads aside); `python bench/inductor_budget.py` measures it
(bench/README.md, "The budget under inductor on every zoo model").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from remat.frontend.workspace import joint_device, profiler_recording, size_hint
from remat.frontend.workspace import measure as measure_workspace

# inductor's classes come from remat.compat inside each function: torch._inductor's codegen
# and ir modules load only when a graph is compiled, not with remat.


def graph_workspace(gm: fx.GraphModule) -> dict[str, int]:
    """Each op's measured workspace in `gm` (`remat.frontend.workspace`, cached per op
    signature: the planner measured the same ops), by node name; none on meta tensors."""
    device = joint_device(gm)
    if device is None or device.type == "meta":
        return {}
    return measure_workspace([n for n in gm.graph.nodes if n.op == "call_function"], device)


def _in_call_bytes(line: Any, workspace: dict[str, int]) -> int:
    """What an extern kernel's call holds beyond what its line allocates, until it
    returns: its workspace (`workspace`, FX name -> bytes: its origin node's, else the
    largest of its origins') and, for a kernel returning several tensors, all of them
    (their `MultiOutputLine`s follow the call, interleaved with frees of its inputs,
    which come later in fact: without them the walk reads LLaMA tiny's attention
    backward 155,552 B under the profiler). 0 for any other line."""
    from remat.compat import inductor_wrapper as w

    if not isinstance(line, (w.ExternKernelAllocLine, w.ExternKernelOutLine)):
        return 0
    node = line.node
    origin = getattr(node, "origin_node", None)
    origins = [origin] if origin is not None else list(getattr(node, "origins", None) or ())
    largest = max(origins, key=lambda o: workspace.get(o.name, 0), default=None)
    scratch = workspace.get(largest.name, 0) if largest is not None else 0
    if scratch:
        scratch = _workspace_as_called(largest, node, scratch)
    outputs = [o for o in tree_leaves(getattr(node, "outputs", None) or []) if hasattr(o, "get_name")]
    return scratch + sum(_multi_output_bytes(o.get_name()) for o in outputs if o is not node)


def _workspace_as_called(origin: fx.Node, kernel: Any, measured: int) -> int:
    """An extern kernel's workspace at the strides inductor calls it with. `measured`,
    its origin node's, is at the strides of the FX graph remat planned; inductor's layout
    optimisation may hand the kernel others (a convolution's input and weight
    channels-last, where oneDNN skips the reorders an NCHW call makes: on cnn tiny's 3x3
    convolutions, a few KB of scratch against a quarter MB). The origin is inductor's
    copy of the node, whose strides may already be the ones it calls with (a backward
    lowered on the forward's layouts), so the call is measured at the kernel's strides
    whatever the origin's are (cached per signature: the same strides cost nothing):
    ResNet tiny's 1x1-spatial `convolution_backward` takes 149,120 B of oneDNN scratch
    channels-last against 148,864 B contiguous. The origin's tensor arguments pair with
    the kernel's inputs in order; where they do not pair (counts or sizes differ), or
    nothing can be run (a profiler is recording), `measured` stands."""
    args = [a for a in tree_leaves((origin.args, origin.kwargs))
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    inputs = list(getattr(kernel, "inputs", None) or ())
    if not args or len(args) != len(inputs) or profiler_recording():
        return measured
    as_called: dict[fx.Node, Any] = {}
    for arg, given in zip(args, inputs):
        val, stride = arg.meta["val"], _stride(given)
        try:
            size = tuple(size_hint(s) for s in val.shape)
            given_size = tuple(_hint(s) for s in given.get_size())
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            return measured
        if stride is None or given_size != size or getattr(val, "fake_mode", None) is None:
            return measured
        with val.fake_mode:
            as_called[arg] = torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)
    graph = fx.Graph()
    env = {}
    for arg in {a: None for a in tree_leaves((origin.args, origin.kwargs)) if isinstance(a, fx.Node)}:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta["val"] = as_called.get(arg, arg.meta.get("val"))
    called = graph.call_function(origin.target, fx.node.map_arg(origin.args, env.__getitem__),
                                 fx.node.map_arg(origin.kwargs, env.__getitem__))
    return measure_workspace([called], next(iter(as_called.values())).device).get(called.name, 0)


def _hint(size: Any) -> int:
    """An inductor size expression by its hint."""
    from remat.compat import V

    return int(V.graph.sizevars.optimization_hint(size, fallback=4096))


def _multi_output_bytes(name: str) -> int:
    """Bytes of one output of a kernel returning several (none where it aliases an input)."""
    from remat.compat import V

    buffer = V.graph.try_get_buffer(name)
    return _buffer_bytes(buffer) if buffer is not None and not buffer.get_inputs_that_alias_output() else 0


def _buffer_bytes(node: Any) -> int:
    """Bytes a buffer owns: none for a view of another (`NonOwningLayout`), a write into
    another (`MutationLayoutSHOULDREMOVE`), or a kernel's tuple of outputs (each output
    is a buffer of its own)."""
    from remat.compat import inductor_ir as ir

    layout = node.get_output_spec()
    if not isinstance(layout, ir.Layout) or isinstance(layout, (ir.NonOwningLayout, ir.MutationLayoutSHOULDREMOVE)):
        return 0
    return _hint(layout.storage_size()) * node.get_dtype().itemsize


def _allocated_bytes(line: Any) -> int:
    """What one wrapper line allocates: a planned allocation, or a buffer an extern
    kernel returns (a fallback op's result, one of its tuple's outputs)."""
    from remat.compat import inductor_wrapper as w

    if isinstance(line, (w.AllocateLine, w.ExternKernelAllocLine)):
        return _buffer_bytes(line.node)
    if isinstance(line, w.MultiOutputLine):
        return _multi_output_bytes(line.result_name)
    return 0


def generated_bytes(counted: dict[str, Any], sizes: dict[str, int] | None = None,
                    workspace: dict[str, int] | None = None) -> int:
    """Peak of the graph inductor is generating (`V.graph`), from its wrapper's planned
    lines: an allocation (or a buffer an extern kernel returns) adds its bytes, a free
    not turned into a reuse removes them, a reuse hands a buffer on (no change). Inputs
    (`counted`: name -> storage, see `counted_inputs`) count once per storage from the
    start, until the free of the last one sharing it or a reuse that hands it on; `sizes`
    (name -> bytes) gives an input's storage bytes where the graph's own input layout
    does not (a saved value the forward's code returns in a buffer of its own).
    `workspace` (FX name -> bytes): an extern kernel's scratch, live while it runs
    (`_in_call_bytes`)."""
    from remat.compat import V
    from remat.compat import inductor_wrapper as w

    graph = V.graph
    sizes = sizes or {}
    sharing: dict[Any, set[str]] = {}
    storage_bytes: dict[Any, int] = {}
    for name, buf in graph.graph_inputs.items():
        if name in counted and hasattr(buf, "get_output_spec"):  # tensors, not SymInts
            sharing.setdefault(counted[name], set()).add(name)
            nbytes = sizes.get(name, _buffer_bytes(buf))
            storage_bytes[counted[name]] = max(storage_bytes.get(counted[name], 0), nbytes)
    live = peak = sum(storage_bytes.values())
    for line in graph.wrapper_code.lines:
        if isinstance(line, w.FreeIfNotReusedLine):
            live -= 0 if line.is_reused else _buffer_bytes(line.node)
        elif isinstance(line, (w.FreeLine, w.ReuseLine)) and line.node.get_name() in counted:
            key = counted[line.node.get_name()]
            names = sharing.get(key, set())
            if isinstance(line, w.ReuseLine):  # the output owns the storage now, and frees it
                names.clear()
                storage_bytes.pop(key, None)
            elif line.node.get_name() in names:
                names.discard(line.node.get_name())
                live -= 0 if names else storage_bytes.pop(key, 0)
        else:
            live += _allocated_bytes(line)
            peak = max(peak, live + _in_call_bytes(line, workspace or {}))
    return peak


def output_storages() -> list[tuple[str, int, bool, tuple[int, ...] | None] | None]:
    """Each output of the graph inductor is generating (`V.graph.graph_outputs`, in the
    FX output's order): the buffer or input whose storage it is, that storage's bytes,
    whether it is one of the graph's inputs, and its strides; None where it is no tensor. Inductor may
    return a view the FX graph makes (a saved `expand`, whose storage is its base's) in
    a buffer of its own, dense, when it realized the view for a kernel anyway (LLaMA's
    `repeat_kv` before attention), and a saved input in a copy of its own (a convolution's
    weight and input, converted to channels-last for its kernel)."""
    from remat.compat import V

    out: list[tuple[str, int, bool, tuple[int, ...] | None] | None] = []
    for r in V.graph.graph_outputs:
        try:
            name = r.get_name()
        except (AttributeError, NotImplementedError):
            out.append(None)
            continue
        buf = V.graph.try_get_buffer(name)
        out.append((name, _buffer_bytes(buf), name in V.graph.graph_inputs, _stride(r))
                   if buf is not None and hasattr(buf, "get_output_spec") else None)
    return out


def _stride(node: Any) -> tuple[int, ...] | None:
    """The strides inductor gives an output (by hint), or None where it has none."""

    try:
        return tuple(_hint(s) for s in node.get_stride())
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None


__all__ = ["generated_bytes", "graph_workspace", "output_storages"]
