"""What FSDP2 (`fully_shard`) holds during a step that no compiled graph sees.

A `fully_shard`-ed model's graphs take the *unsharded* parameters as arguments (FSDP2's
hooks all-gather them before a wrapped module runs and free them after); everything else
FSDP2 allocates lives outside every graph: the sharded parameters and the sharded
gradients (DTensors, never graph arguments), the unsharded parameters of the groups
that are all-gathered but not running (the root's stay unsharded from its forward to
its post-backward; in backward the next group is prefetched), and the collectives'
buffers: an all-gather's flat output (the group's padded unsharded size, kept in forward
until the next group's copy-out), a reduce-scatter's input (likewise, kept until the
next group's reduce-scatter) and its output (the new sharded gradient).

`FsdpState` finds the FSDP2 states of the model whose unsharded parameters a graph takes
(torch's composable-state registry), and gives the ledger, when a graph is called:

- `live`: the storages FSDP2 holds now (each at its size now: a resharded parameter's
  storage is resized to 0);
- `transient_bytes`: a bound on what FSDP2 allocates around the call beyond what its
  start sees. Forward (FSDP2's pre-forward hook, before the call): the previous group's
  all-gather output, still held while this group's is copied out, and the parameters'
  cast to `param_dtype` for the all-gather. Backward: the reduce-scatter input of the
  group after it and the backward prefetch's all-gather output (two group-sized buffers
  at once), the reduce-scatter's output (and its cast back to the parameters' dtype under
  mixed precision), and the sharded gradients that do not exist yet (set to None before
  the step) of the groups that can reduce-scatter before the call's backward ends (none
  whose parameters an earlier call of the step took); the all-gather output held at the
  call's start is freed by then;
- `transient_grads`: the unsharded parameters whose gradients FSDP2 may reduce-scatter
  and free right after their group's backward (every group but the root's: its
  post-backward waits for the end of the backward), so that the ledger does not count
  them as living until the end of the backward.

FSDP2 reduce-scatters a non-root group's gradients as soon as its backward ends when its
forward took an input that requires grad (its post-backward hook hangs on those inputs);
otherwise the root's final callback does, at the end of the backward. The ledger treats a
group's gradients as freed early only when a graph call took the group's parameters with
a non-parameter argument that requires grad (a transformer block's hidden states); the
rest it counts as living until the end of the backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from remat.compat import fsdp_param_groups, fsdp_state_refs
from remat.runtime.step.storages import key as _key


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a sharded parameter or gradient), else `t`."""
    return getattr(t, "_local_tensor", t)


class FsdpState:
    """The FSDP2 states of one model, found from the unsharded parameters its graphs take."""

    def __init__(self) -> None:
        self._states: list[weakref.ref] = []

    @property
    def found(self) -> bool:
        return any(ref() is not None for ref in self._states)

    def discover(self, args: Sequence[Any]) -> None:
        """Find the model's FSDP2 states from a graph call's arguments (once)."""
        if self.found:
            return
        refs = fsdp_state_refs()
        if not refs:  # FSDP2 not loaded, or loaded (torch.compile imports it) but no model sharded
            return
        keys = {_key(a) for a in args if isinstance(a, torch.nn.Parameter)}
        if not keys:
            return
        for ref in refs:
            state = ref()
            groups = fsdp_param_groups(state)
            if not groups or not any(_key(p._unsharded_param) in keys for g in groups
                                     for p in g.fsdp_params if hasattr(p, "_unsharded_param")):
                continue
            context = getattr(state, "_state_ctx", None)
            states = context.all_states if context is not None and context.all_states else [state]
            self._states = [weakref.ref(s) for s in states]
            return

    def _groups(self) -> Iterator[tuple[Any, Any]]:
        """(state, param group) of every live state."""
        for ref in self._states:
            state = ref()
            if state is not None:
                for group in fsdp_param_groups(state):
                    yield state, group

    def live(self) -> dict[int, int]:
        """The storages FSDP2 holds now, at their size now."""
        out: dict[int, int] = {}

        def add(t: torch.Tensor | None) -> None:
            if isinstance(t, torch.Tensor):
                t = _local(t)
                out[_key(t)] = t.untyped_storage().nbytes()

        contexts = {}
        for _, group in self._groups():
            contexts[id(group.comm_ctx)] = group.comm_ctx
            for p in group.fsdp_params:
                add(p._sharded_param_data)
                add(getattr(p, "_sharded_post_forward_param_data", None))
                add(p.sharded_param.grad)
                if hasattr(p, "_unsharded_param"):
                    add(p._unsharded_param)
                    add(p._unsharded_param.grad)
                add(getattr(p, "unsharded_accumulated_grad", None))
            # buffers FSDP2 keeps between hooks (private attributes of torch 2.13's
            # FSDPParamGroup: absent in another version means not kept there)
            result = getattr(group, "_all_gather_result", None)
            add(result.all_gather_output if result is not None else None)
            add(getattr(group, "_partial_reduce_output", None))
            reduce_state = getattr(group, "_all_reduce_state", None)
            add(reduce_state.all_reduce_input if reduce_state is not None else None)
        for context in contexts.values():
            gather = getattr(context, "all_gather_state", None)
            add(gather.all_gather_result.all_gather_output if gather is not None else None)
            for scatter in getattr(context, "reduce_scatter_states", ()):
                add(scatter.reduce_scatter_input)
        return out

    def transient_bytes(self, earlier: frozenset = frozenset()) -> int:
        """A bound on what FSDP2 allocates around one graph call, beyond `live` at its start.
        `earlier`: the storages of the parameters that earlier graph calls of this step
        took. A group whose parameters an earlier call took reduce-scatters after that
        call's backward (FSDP2's post-backward fires once a group's forward inputs have
        their gradients, or at the end of the backward), so after this call's backward:
        its sharded gradients, when the step started without them, do not exist yet."""
        buffers, outputs, casts, missing_grads = [0], [0], [0], 0
        for _, group in self._groups():
            done_after = any(hasattr(p, "_unsharded_param") and _key(p._unsharded_param) in earlier
                             for p in group.fsdp_params)
            world = getattr(group.mesh_info, "shard_mesh_size", 1)
            gather = scatter = output = cast = 0
            for p in group.fsdp_params:
                numel = p.padded_sharded_param_size.numel()
                param_dtype = p.param_dtype or p.orig_dtype
                reduce_dtype = p.reduce_dtype or param_dtype
                gather += numel * world * param_dtype.itemsize
                scatter += numel * world * reduce_dtype.itemsize
                output += numel * (reduce_dtype.itemsize
                                   + (p.orig_dtype.itemsize if reduce_dtype != p.orig_dtype else 0))
                cast += numel * param_dtype.itemsize if param_dtype != p.orig_dtype else 0
                if p.sharded_param.requires_grad and p.sharded_param.grad is None and not done_after:
                    missing_grads += numel * p.orig_dtype.itemsize
            buffers.append(max(gather, scatter))
            outputs.append(output)
            casts.append(cast)
        # forward: the previous group's all-gather output and this group's cast (before
        # the call starts: FSDP2's hook, while what the call's start saw is live too);
        # backward: the reduce-scatter input of the group after it and the prefetched
        # all-gather of the one before it, this group's reduce-scatter output, the
        # gradients that do not exist yet; the all-gather output held at the call's
        # start is freed by then (FSDP2's root flushes it when the forward ends)
        forward = max(buffers) + max(casts)
        backward = sum(sorted(buffers, reverse=True)[:2]) + max(outputs) + max(casts) + missing_grads
        return max(forward, backward - self._held_gather_bytes())

    def _held_gather_bytes(self) -> int:
        """The all-gather output FSDP2 keeps in forward until the next group's copy-out."""
        held = {}
        for _, group in self._groups():
            gather = getattr(group.comm_ctx, "all_gather_state", None)
            if gather is not None:
                out = gather.all_gather_result.all_gather_output
                held[_key(out)] = out.untyped_storage().nbytes()
        return sum(held.values())

    def transient_grads(self) -> frozenset[int]:
        """Unsharded parameters whose gradients FSDP2 may free right after their group's
        backward (reduce-scattered): every group's but the root's (the ledger keeps those
        of graph calls fed by an input that requires grad)."""
        return frozenset(_key(p._unsharded_param) for state, group in self._groups()
                         if not state._is_root for p in group.fsdp_params if hasattr(p, "_unsharded_param"))

    def unsharded(self) -> frozenset[int]:
        """Every unsharded parameter's storage (counted by `live` at its size now)."""
        return frozenset(_key(p._unsharded_param) for _, group in self._groups()
                         for p in group.fsdp_params if hasattr(p, "_unsharded_param"))
