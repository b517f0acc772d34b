"""Trace a model into AOTAutograd's joint forward+backward graph and compile it with a
partitioner of ours.

Route: the model is wrapped in a `FlatModel` (flat tensor inputs, flat tensor outputs,
only the loss differentiable) and handed to `aot_module_simplified`, which traces
`functional_call` with fake tensors through `make_fx` (functionalized ATen, every node
with `meta["val"]`). AOTAutograd calls our `partition_fn` with the joint graph; we plan
there and return the forward and backward GraphModules. AOTAutograd's own runtime then
runs them inside its `autograd.Function`: saved tensors are handed to backward and freed
as backward consumes them, input mutations (BatchNorm running stats) are applied once
in the forward epilogue, and RNG ops run only in the forward graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx import traceback as fx_traceback
from torch.nn.modules import module as module_hooks

from remat.compat import (
    BoxedCodeGen,
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
    UserError,
    functorch_config,
)
from remat.errors import TraceError
from remat.frontend.layouts import eager_cpu_layouts

log = logging.getLogger(__name__)

Partitioner = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


@dataclasses.dataclass(frozen=True)
class FlatSignature:
    """How a call's (args, kwargs) map to the flat tensor list, and its cache key."""

    spec: pytree.TreeSpec
    tensor_positions: tuple[int, ...]
    constants: tuple[Any, ...]
    key: tuple[Any, ...]

    @staticmethod
    def of(args: Sequence[Any], kwargs: dict[str, Any], training: bool) -> "FlatSignature":
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        constants = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        shapes = tuple(
            (tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
            for x in leaves
            if isinstance(x, torch.Tensor)
        )
        try:
            hash(constants)
            const_key: Any = constants
        except TypeError:
            const_key = repr(constants)
        key = (training, str(spec), shapes, const_key, autocast_state())
        return FlatSignature(spec, positions, constants, key)

    def tensors(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        return [leaves[i] for i in self.tensor_positions]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.constants)
        for i, t in zip(self.tensor_positions, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions active now, as (device type, dtype): part of a plan's key,
    because the joint graph carries autocast's casts explicitly (a plan traced under bf16
    autocast runs bf16 matmuls even when called outside autocast)."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )


def find_loss(output: Any) -> torch.Tensor:
    """The scalar loss of a model's output: `output.loss`, `output["loss"]`, or the
    output itself when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor)
                else type(output).__name__)
        raise TraceError(
            f"the model returned {what}, which has no scalar loss: return a "
            "scalar tensor, or an object with a scalar `.loss` (e.g. pass labels to a "
            "transformers model)"
        )
    return loss


class FlatModel(nn.Module):
    """The model as a function of flat tensors; outputs flattened, only the loss
    differentiable (remat plans the backward of the loss; other outputs are detached).
    `outputs="loss"` (as `remat.plan` takes it): the loss is the only output; the other
    tensors die inside the step, and `unflatten` gives None in their place."""

    def __init__(self, model: nn.Module, signature: FlatSignature, *, outputs: str = "all") -> None:
        super().__init__()
        self.model = model
        self.signature = signature
        self.outputs = outputs
        self.out_spec: pytree.TreeSpec | None = None
        self.out_positions: tuple[int, ...] = ()
        self.out_constants: tuple[Any, ...] = ()

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self.signature.rebuild(tensors)
        output = self.model(*args, **kwargs)
        loss = find_loss(output)
        leaves, spec = pytree.tree_flatten(output)
        self.out_spec = spec
        tensor_leaves = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if self.outputs == "loss":
            tensor_leaves = [next(i for i in tensor_leaves if leaves[i] is loss)]
        self.out_positions = tuple(tensor_leaves)
        # a tensor output not returned comes back as None
        self.out_constants = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        return tuple(leaves[i] if leaves[i] is loss else leaves[i].detach() for i in self.out_positions)

    def unflatten(self, flat: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.out_constants)
        for i, t in zip(self.out_positions, flat):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.out_spec)


class TensorsOnce(nn.Module):
    """`module` with each parameter and buffer object registered once, for AOTAutograd.

    `aot_module_simplified` lists `named_parameters(remove_duplicate=False)`, so a tied
    weight (GPT-2's and BERT's input and output embeddings) would be two primals with two
    gradients, summed by the autograd engine after the planned backward returns, outside
    the memory model (in place when nothing else holds the buffers, out of place under a
    dispatch mode). Registered once, it is one primal: autograd sums its gradients inside
    the joint graph, where the planner sees and schedules the sum. The wrapped module is
    called with `functional_call`, each of its names bound to the one registered tensor."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.__dict__["inner"] = module  # not a submodule: its tensors are registered below
        self.__dict__["bindings"] = {}  # the inner module's name -> own name
        own: dict[int, str] = {}
        for kind, named in (("p", module.named_parameters(remove_duplicate=False)),
                            ("b", module.named_buffers(remove_duplicate=False))):
            for name, tensor in named:
                if id(tensor) not in own:
                    own[id(tensor)] = f"{kind}{len(own)}"
                    register = self.register_parameter if kind == "p" else self.register_buffer
                    register(own[id(tensor)], tensor)
                self.bindings[name] = own[id(tensor)]

    @staticmethod
    def has_tied(module: nn.Module) -> bool:
        """Whether some parameter or buffer object is registered under two names."""
        return (len(dict(module.named_parameters(remove_duplicate=False)))
                != len(list(module.parameters()))
                or len(dict(module.named_buffers(remove_duplicate=False))) != len(list(module.buffers())))

    def forward(self, *tensors: torch.Tensor) -> Any:
        bound = {name: getattr(self, own) for name, own in self.bindings.items()}
        return torch.func.functional_call(self.inner, bound, tensors, strict=True)


def boxed_eager_compiler(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """Run the graph eagerly with the boxed calling convention: the generated code
    clears its argument list, so saved tensors die at their last use in backward
    (with a plain call, the caller's list would keep every one alive to the end)."""
    gm.graph.set_codegen(BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        # `gm.forward`, not `gm(...)`: calling the module fires global module hooks
        # (FlopCounterMode's module tracker, profilers, FSDP, users' hooks) on an fx
        # module that runs inside AOTAutograd's autograd.Function, where they fail
        # ("Expected gradient function to be set") or count the step twice.
        return gm.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


_DATA_DEPENDENT = (
    UserError,
    GuardOnDataDependentSymNode,
    DynamicOutputShapeException,
    DataDependentOutputException,
)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A compiled step and how it was traced."""

    compiled: Callable[..., Any]
    library_trace_path: str
    """Empty when the model was traced on its eager code path; otherwise where that path
    branched on tensor values (' at file:line (source)'), so it was traced with
    `torch.compiler.is_compiling()` set, in which case libraries may run a different,
    equivalent program, equal to eager up to rounding (transformers' LLaMA attention
    builds an explicit mask and repeats the key and value heads, `repeat_kv`, in place of
    SDPA's `enable_gqa`: under bf16 their gradients round per head before the sum)."""


def compile_joint(
    module: nn.Module, tensors: Sequence[torch.Tensor], partition_fn: Partitioner,
    *, user_model: nn.Module | None = None,
) -> Traced:
    """Trace `module` (a function of flat tensors) on `tensors` and compile it with
    `partition_fn` (which AOTAutograd calls once, with the joint graph); nodes are
    stamped with the submodules of `user_model` (default: `module`) that made them.

    First on the model's eager code path, so the traced program is the one eager runs;
    if that path branches on tensor values, again as non-strict `torch.export` does,
    with `torch.compiler.is_compiling()` true, where libraries take trace-friendly paths."""
    from remat.compat import compiling_state_context  # on use: for a model branching on values

    user_model = module if user_model is None else user_model
    try:
        return Traced(_aot(module, user_model, tensors, partition_fn), "")
    except _DATA_DEPENDENT as eager_error:
        first = _failure_location(eager_error)
        log.warning("remat: the model's eager path branches on tensor values%s; tracing again "
                    "with torch.compiler.is_compiling() set, as torch.export does", first)
        try:
            with compiling_state_context():
                return Traced(_aot(module, user_model, tensors, partition_fn), first)
        except _DATA_DEPENDENT as e:
            raise TraceError(_trace_failure_message(e)) from e


def _aot(module: nn.Module, user_model: nn.Module, tensors: Sequence[torch.Tensor],
         partition_fn: Partitioner):
    from remat.compat import aot_module_simplified  # on use: not loaded with remat

    # Backward compiled now, not lazily at the first backward: the lazy path deep-copies
    # the backward module there, allocating its tensor constants inside the first step
    # (measured: 8 B on a T5 and a Whisper, the allocator 8 B above the prediction and the
    # budget at their floors).
    with _record_module_locations(user_model), eager_cpu_layouts(), functorch_config.patch(
            force_non_lazy_backward_lowering=True):
        try:
            return aot_module_simplified(
                module,
                list(tensors),
                fw_compiler=boxed_eager_compiler,
                bw_compiler=boxed_eager_compiler,
                partition_fn=partition_fn,
            )
        except NotImplementedError as e:
            if "Generator" not in str(e):  # torch 2.11 (`compat.traces_generators`)
                raise
            raise TraceError(
                "the model passes a torch.Generator to a random op (generator=...), which torch "
                f"{torch.__version__} cannot trace ({e}); torch 2.13 and newer can: upgrade torch, "
                "or draw from the default generator (torch.manual_seed)") from e


@functools.lru_cache(maxsize=None)
def _forward_location(cls: type) -> str:
    try:
        lines, first = inspect.getsourcelines(cls.forward)
        path = str(inspect.getsourcefile(cls.forward))
        return f"{path.rsplit('site-packages/', 1)[-1]}:{first}"
    except (OSError, TypeError):
        return ""


@contextlib.contextmanager
def _record_module_locations(model: nn.Module):
    """While tracing, stamp every node with the module that ran it: AOTAutograd's
    make_fx copies `fx.traceback.current_meta` into each node it creates when node meta
    is preserved. Stored as `nn_module_stack`: {path: (path, class, 'file:line')}."""
    names = {id(m): name for name, m in model.named_modules()}
    saved: list[Any] = []

    def pre(module: nn.Module, _args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        stack = dict(fx_traceback.current_meta.get("nn_module_stack") or {})
        saved.append(fx_traceback.current_meta.get("nn_module_stack"))
        stack[name or "<model>"] = (name or "<model>", type(module), _forward_location(type(module)))
        fx_traceback.current_meta["nn_module_stack"] = stack

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in names and saved:
            fx_traceback.current_meta["nn_module_stack"] = saved.pop()

    with fx_traceback.preserve_node_meta():
        h1 = module_hooks.register_module_forward_pre_hook(pre)
        h2 = module_hooks.register_module_forward_hook(post)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


def _failure_location(error: BaseException) -> str:
    """' at file:line (source)' of the innermost non-torch frame, or ''."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__)
        if "/torch/" not in f.filename and "/remat/" not in f.filename
    ]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


def _trace_failure_message(error: BaseException) -> str:
    """Name the user source line torch was at when tracing failed."""
    where = _failure_location(error)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"could not trace the model into a joint graph{where}: {type(error).__name__}: {first}. "
        "remat needs a model whose control flow does not depend on tensor values "
        "(no .item()/nonzero()-driven branches); rewrite that line or run it outside the model, "
        "or compile the model with torch.compile(model, backend=remat.backend(budget=...)), "
        "which splits the graph at such a branch (e.g. layerdrop) and plans each piece"
    )
