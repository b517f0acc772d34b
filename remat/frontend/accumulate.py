"""Gradient sums written in place: which `add` of a parameter's gradients may overwrite
one of its operands.

A parameter used twice (a tied embedding passed to AOTAutograd once, a weight shared by
two layers) gets the sum of its gradients as one `aten.add.Tensor` in the joint graph,
whose result is the parameter's gradient (a graph output). Run as written, the sum needs
a third gradient-sized buffer while both operands are still live. Eager autograd sums in
place into one operand when nothing else holds it (`InputBuffer::accumulate`); so do we:
the problem models the sum as an alias of the operand it overwrites, and the rewriter
runs `add_` on it. IEEE addition is commutative, so `b.add_(a)` equals `a + b` bit for
bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from remat.compat import statically_known_true
from remat.frontend.profile import storage_key, tensor_val

_ADD = torch.ops.aten.add.Tensor
ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def in_place_operand(node: fx.Node, is_backward: Callable[[str], bool]) -> int | None:
    """For a gradient sum `add(a, b)` (an output of the joint graph), the position (0 or
    1) of an operand it can overwrite: a backward value (`is_backward(name)`, not a view)
    that only this add reads, owns its storage, and has the result's shape, dtype
    and strides. None when the node is no such sum or neither operand qualifies."""
    if node.target is not _ADD or len(node.args) != 2 or node.kwargs:
        return None
    if not any(user.op == "output" for user in node.users):
        return None
    out = tensor_val(node)
    if out is None:
        return None
    for pos, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and is_backward(arg.name) and _overwritable(arg, out):
            return pos
    return None


def _overwritable(arg: fx.Node, out: torch.Tensor) -> bool:
    val = tensor_val(arg)
    if val is None or arg.op != "call_function" or len(arg.users) != 1:
        return False
    if (val.dtype, val.device, val.dim()) != (out.dtype, out.device, out.dim()):
        return False
    # symbolic sizes (dynamic shapes) compare without adding a guard
    if not all(statically_known_true(x == y) for x, y in zip((*val.shape, *val.stride()),
                                                             (*out.shape, *out.stride()))):
        return False
    key = storage_key(val)  # a view of one of its inputs does not own its storage
    return all(tensor_val(a) is None or storage_key(tensor_val(a)) != key for a in arg.all_input_nodes)


def sum_in_place(gm: fx.GraphModule, operands: dict[str, int]) -> None:
    """Rewrite each `add` named in `operands` to `add_` into the chosen operand."""
    for node in gm.graph.nodes:
        pos = operands.get(node.name)
        if pos is None or node.target is not _ADD:
            continue
        a, b = node.args
        node.target = ADD_IN_PLACE
        node.args = (a, b) if pos == 0 else (b, a)
