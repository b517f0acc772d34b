"""Problem builders: joint forward+backward problems from a forward description.

`joint_from_forward` derives the backward half the way reverse-mode autodiff does:
 - the loss tangent is a BACKWARD node with no inputs;
 - for each forward op (in reverse order) whose output has a gradient, one backward node
   per differentiable input computes that input's gradient contribution; it reads the
   output's gradient plus the forward values the op's derivative needs (`grad_reads`:
   a matmul reads its inputs, a relu its output, an add nothing);
 - a value with several gradient contributions gets an accumulation node, emitted as
   soon as its last contribution exists;
 - the loss and the gradients of parameters (and of inputs with requires_grad) are
   the problem's outputs.
Ops whose gradient is a view of the output gradient (add, reshape, concat) mark their
input gradients `alias_of` the output gradient, so they cost no new storage.

The named builders (chains, random DAGs, transformer and U-Net stacks) are for tests and
benchmarks. Every builder takes `budget_bytes` (default: the no-remat peak, i.e. the
peak of solve "none") and `offload_bandwidth_bytes_per_s` (default None: no offload).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from remat_solvers.problem import Decision, Node, Phase, Problem, decisions_all
from remat_solvers.simulate import evaluate

# Roofline figures for the synthetic cost model (an H100-class device, order of
# magnitude only): seconds = max(flops / PEAK_FLOPS, bytes_moved / PEAK_BYTES_PER_S).
PEAK_FLOPS = 400e12
PEAK_BYTES_PER_S = 2e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class FwdOp:
    """One value of a forward description (a parameter, an input or a forward op)."""

    name: str
    """Readable name; backward nodes derive theirs from it."""
    out_bytes: int
    """Bytes of the value."""
    inputs: tuple[int, ...] = ()
    """Indices (into the same forward description) of the values this op reads."""
    phase: Phase = Phase.FORWARD
    """PARAM, INPUT or FORWARD."""
    compute_s: float = 0.0
    """Seconds to run the op once; each input-gradient node costs the same."""
    grad_reads: tuple[int, ...] = ()
    """Forward indices (among `inputs`, or this op's own index) that the derivative reads."""
    grad_alias: bool = False
    """The input gradients are views of the output gradient (add, reshape, concat)."""
    alias_of: int | None = None
    """Index of the input this value views (reshape, transpose, slice)."""
    recomputable: bool = True
    """False for random, mutating or collective ops (dropout masks)."""
    offloadable: bool = True
    """False for values that cannot be moved to host memory."""
    differentiable: bool = True
    """False for ops no gradient flows through (random masks, integer indices)."""
    requires_grad: bool | None = None
    """For PARAM/INPUT: whether a gradient is wanted (default: PARAM yes, INPUT no)."""


def joint_from_forward(
    ops: Sequence[FwdOp],
    *,
    loss: int | None = None,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """The joint forward+backward Problem of `ops` (loss: index of the loss, default last).

    `ops` must list PARAM/INPUT values first, then forward ops, each reading only earlier
    indices; node ids in the Problem equal the indices in `ops`."""
    n = len(ops)
    loss = n - 1 if loss is None else loss
    if not 0 <= loss < n or ops[loss].phase is not Phase.FORWARD:
        raise ValueError(f"loss={loss} must be the index of a FORWARD op (0..{n - 1})")
    nodes = [_forward_node(op) for op in ops]
    has_grad = _has_grad(ops, loss)
    # expected[u]: how many ops send a gradient contribution to u.
    expected = [0] * n
    for v, op in enumerate(ops):
        if has_grad[v] and op.differentiable:
            for u in dict.fromkeys(op.inputs):
                expected[u] += has_grad[u]
    contributions: list[list[int]] = [[] for _ in range(n)]
    grad: dict[int, int] = {loss: _append(nodes, Node(
        name=f"tangent_{ops[loss].name}", inputs=(), out_bytes=ops[loss].out_bytes,
        phase=Phase.BACKWARD))}
    for v in range(loss, -1, -1):
        op = ops[v]
        if v not in grad or not op.differentiable or op.phase is not Phase.FORWARD:
            continue
        g = grad[v]
        reads = tuple(dict.fromkeys(op.grad_reads))
        for u in dict.fromkeys(op.inputs):
            if not has_grad[u]:
                continue
            contributions[u].append(_append(nodes, Node(
                name=f"grad_{ops[u].name}_from_{op.name}",
                inputs=(g, *reads),
                out_bytes=ops[u].out_bytes,
                phase=Phase.BACKWARD,
                compute_s=op.compute_s,
                alias_of=g if op.grad_alias else None,
            )))
            if len(contributions[u]) == expected[u]:
                grad[u] = _accumulate(nodes, ops[u], contributions[u])
    # The gradients of parameters (and of inputs that want one) leave the step.
    outputs = [loss] + [grad[u] for u, op in enumerate(ops) if op.phase is not Phase.FORWARD and u in grad]
    return _finalize(nodes, outputs, budget_bytes, offload_bandwidth_bytes_per_s)


def _forward_node(op: FwdOp) -> Node:
    return Node(
        name=op.name, inputs=op.inputs, out_bytes=op.out_bytes, phase=op.phase,
        compute_s=op.compute_s, alias_of=op.alias_of, recomputable=op.recomputable,
        offloadable=op.offloadable,
    )


def _has_grad(ops: Sequence[FwdOp], loss: int) -> list[bool]:
    """has_grad[u]: u requires grad (a gradient is wanted through it) and feeds the loss."""
    requires = []
    for op in ops:
        if op.phase is Phase.FORWARD:
            requires.append(op.differentiable and any(requires[u] for u in op.inputs))
        elif op.requires_grad is None:
            requires.append(op.phase is Phase.PARAM)
        else:
            requires.append(op.requires_grad)
    feeds = [False] * len(ops)
    feeds[loss] = True
    for v in range(loss, -1, -1):
        if feeds[v] and ops[v].differentiable:
            for u in ops[v].inputs:
                feeds[u] = True
    return [r and f for r, f in zip(requires, feeds)]


def _append(nodes: list[Node], node: Node) -> int:
    nodes.append(node)
    return len(nodes) - 1


def _accumulate(nodes: list[Node], op: FwdOp, parts: list[int]) -> int:
    if len(parts) == 1:
        return parts[0]
    return _append(nodes, Node(
        name=f"grad_{op.name}", inputs=tuple(parts), out_bytes=op.out_bytes,
        phase=Phase.BACKWARD, compute_s=_roofline(len(parts) * op.out_bytes / 4, (len(parts) + 1) * op.out_bytes),
    ))


def _finalize(
    nodes: list[Node], outputs: list[int], budget_bytes: int | None, bandwidth: float | None
) -> Problem:
    problem = Problem(nodes=tuple(nodes), outputs=tuple(outputs), budget_bytes=0,
                      offload_bandwidth_bytes_per_s=bandwidth)
    if budget_bytes is None:
        budget_bytes = no_remat_peak(problem)
    return problem.with_budget(budget_bytes)


# ---- budgets ----


def no_remat_peak(problem: Problem) -> int:
    """Peak bytes of the plan that saves everything (solve "none")."""
    return evaluate(problem, decisions_all(problem, Decision.SAVE)).peak_bytes


def with_budget_fraction(problem: Problem, fraction: float) -> Problem:
    """`problem` with budget_bytes = floor(fraction * its no-remat peak)."""
    if not fraction >= 0:
        raise ValueError(f"fraction must be >= 0, got {fraction!r}")
    return problem.with_budget(math.floor(fraction * no_remat_peak(problem)))


# ---- named builders ----


def _roofline(flops: float, bytes_moved: float) -> float:
    return max(flops / PEAK_FLOPS, bytes_moved / PEAK_BYTES_PER_S)


def chain(
    n_layers: int,
    *,
    activation_bytes: int = 1 << 20,
    compute_s: float = 1e-3,
    param_bytes: int = 1 << 10,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """A homogeneous chain: x -> layer_1 -> ... -> layer_n -> loss, each layer a linear-like
    op with its own parameter whose derivative reads the layer's input."""
    return heterogeneous_chain(
        [activation_bytes] * n_layers, [compute_s] * n_layers, param_bytes=param_bytes,
        budget_bytes=budget_bytes, offload_bandwidth_bytes_per_s=offload_bandwidth_bytes_per_s,
    )


def heterogeneous_chain(
    activation_bytes: Sequence[int],
    compute_s: Sequence[float],
    *,
    param_bytes: int = 1 << 10,
    input_bytes: int | None = None,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """A chain whose layer i outputs activation_bytes[i] and costs compute_s[i]."""
    if len(activation_bytes) != len(compute_s) or not activation_bytes:
        raise ValueError("activation_bytes and compute_s must be non-empty and of equal length")
    ops = [FwdOp(name="x", out_bytes=activation_bytes[0] if input_bytes is None else input_bytes,
                 phase=Phase.INPUT)]
    prev = 0
    for i, (b, c) in enumerate(zip(activation_bytes, compute_s)):
        ops.append(FwdOp(name=f"w{i}", out_bytes=param_bytes, phase=Phase.PARAM))
        ops.append(FwdOp(name=f"h{i}", out_bytes=b, inputs=(prev, len(ops) - 1),
                         compute_s=c, grad_reads=(prev, len(ops) - 1)))
        prev = len(ops) - 1
    ops.append(_loss_op(ops, prev))
    return joint_from_forward(params_first(ops), budget_bytes=budget_bytes,
                              offload_bandwidth_bytes_per_s=offload_bandwidth_bytes_per_s)


def _loss_op(ops: Sequence[FwdOp], logits: int) -> FwdOp:
    b = ops[logits].out_bytes
    return FwdOp(name="loss", out_bytes=4, inputs=(logits,), compute_s=_roofline(b, b),
                 grad_reads=(logits,))


def random_dag(
    n_forward: int,
    *,
    seed: int = 0,
    n_params: int | None = None,
    skip_prob: float = 0.3,
    max_skip: int = 8,
    min_bytes: int = 1 << 10,
    max_bytes: int = 1 << 20,
    nonrecomputable_prob: float = 0.0,
    view_prob: float = 0.0,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """A seeded random layered DAG: op i reads op i-1, a parameter, and with probability
    `skip_prob` an earlier op up to `max_skip` back (a skip connection)."""
    rng = random.Random(seed)
    n_params = max(1, n_forward // 4) if n_params is None else n_params
    ops = [FwdOp(name="x", out_bytes=rng.randint(min_bytes, max_bytes), phase=Phase.INPUT)]
    ops += [FwdOp(name=f"w{p}", out_bytes=rng.randint(min_bytes, max_bytes) // 16, phase=Phase.PARAM)
            for p in range(n_params)]
    first = len(ops)
    for k in range(n_forward):
        v = len(ops)
        prev = v - 1 if k else 0
        ins = [prev, rng.randrange(1, first)] if n_params else [prev]
        if k > 1 and rng.random() < skip_prob:
            ins.append(rng.randrange(max(first, v - max_skip), v - 1))
        out_bytes = rng.randint(min_bytes, max_bytes)
        is_view = k > 0 and rng.random() < view_prob
        ops.append(FwdOp(
            name=f"v{k}", out_bytes=ops[prev].out_bytes if is_view else out_bytes,
            inputs=tuple(ins), compute_s=rng.uniform(0.1, 1.0) * 1e-3,
            grad_reads=tuple(i for i in ins if rng.random() < 0.7),
            alias_of=prev if is_view else None,
            recomputable=rng.random() >= nonrecomputable_prob,
        ))
    ops.append(_loss_op(ops, len(ops) - 1))
    return joint_from_forward(ops, budget_bytes=budget_bytes,
                              offload_bandwidth_bytes_per_s=offload_bandwidth_bytes_per_s)


def transformer(
    n_blocks: int,
    *,
    batch: int = 8,
    seq: int = 512,
    d_model: int = 768,
    n_heads: int = 12,
    d_ff: int | None = None,
    vocab: int = 32000,
    dtype_bytes: int = 2,
    dropout: bool = False,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """A pre-LayerNorm transformer stack: per block LayerNorm, q/k/v projections, head
    reshapes (views of their input), scores, softmax, optional dropout (a saved,
    non-recomputable random mask), attention, head merge (a view), output projection,
    residual add, LayerNorm, MLP with GELU, residual add; then LayerNorm, logits, loss."""
    b = _Builder(dtype_bytes)
    d_ff = 4 * d_model if d_ff is None else d_ff
    tokens = batch * seq
    x = b.input("x", tokens * d_model)
    for i in range(n_blocks):
        h = b.layernorm(f"ln1_{i}", x, tokens, d_model)
        q, k, v = (b.linear(f"{p}_{i}", h, tokens, d_model, d_model) for p in "qkv")
        qh, kh, vh = (b.view(f"{p}h_{i}", t) for p, t in zip("qkv", (q, k, v)))
        scores = b.op(f"scores_{i}", (qh, kh), batch * n_heads * seq * seq,
                      flops=2 * tokens * seq * d_model, grad_reads=(qh, kh))
        probs = b.op(f"softmax_{i}", (scores,), batch * n_heads * seq * seq,
                     flops=5 * batch * n_heads * seq * seq, grad_reads="self")
        if dropout:
            probs = b.dropout(f"attn_drop_{i}", probs)
        attn = b.op(f"attn_{i}", (probs, vh), tokens * d_model,
                    flops=2 * tokens * seq * d_model, grad_reads=(probs, vh))
        merged = b.view(f"merge_{i}", attn)
        o = b.linear(f"o_{i}", merged, tokens, d_model, d_model)
        x = b.add(f"res1_{i}", x, o)
        h = b.layernorm(f"ln2_{i}", x, tokens, d_model)
        up = b.linear(f"fc1_{i}", h, tokens, d_model, d_ff)
        act = b.op(f"gelu_{i}", (up,), tokens * d_ff, flops=8 * tokens * d_ff, grad_reads=(up,))
        down = b.linear(f"fc2_{i}", act, tokens, d_ff, d_model)
        if dropout:
            down = b.dropout(f"mlp_drop_{i}", down)
        x = b.add(f"res2_{i}", x, down)
    h = b.layernorm("ln_f", x, tokens, d_model)
    logits = b.linear("logits", h, tokens, d_model, vocab)
    b.ops.append(_loss_op(b.ops, logits))
    return joint_from_forward(b.sorted_ops(), budget_bytes=budget_bytes,
                              offload_bandwidth_bytes_per_s=offload_bandwidth_bytes_per_s)


def unet(
    depth: int,
    *,
    batch: int = 8,
    channels: int = 64,
    resolution: int = 128,
    dtype_bytes: int = 2,
    budget_bytes: int | None = None,
    offload_bandwidth_bytes_per_s: float | None = None,
) -> Problem:
    """A U-Net: `depth` encoder levels (conv, relu, downsample, channels x2, resolution /2),
    a bottleneck, and decoder levels that upsample and concatenate the matching encoder
    output (a long skip whose gradient is a view of the concat's gradient)."""
    b = _Builder(dtype_bytes)
    c, r = channels, resolution
    x = b.input("x", batch * 3 * r * r)
    skips = []
    for i in range(depth + 1):
        x = b.conv(f"enc{i}", x, batch, c, r)
        if i == depth:
            break
        skips.append(x)
        x = b.op(f"down{i}", (x,), batch * c * (r // 2) ** 2, flops=batch * c * r * r, grad_reads=())
        c, r = c * 2, max(1, r // 2)
    for i in reversed(range(depth)):
        c, r = c // 2, r * 2
        x = b.op(f"up{i}", (x,), batch * c * r * r, flops=batch * c * r * r, grad_reads=())
        x = b.op(f"cat{i}", (x, skips[i]), 2 * batch * c * r * r, flops=0, grad_reads=(),
                 grad_alias=True)
        x = b.conv(f"dec{i}", x, batch, c, r)
    b.ops.append(_loss_op(b.ops, x))
    return joint_from_forward(b.sorted_ops(), budget_bytes=budget_bytes,
                              offload_bandwidth_bytes_per_s=offload_bandwidth_bytes_per_s)


class _Builder:
    """Appends FwdOps with roofline costs; parameters are hoisted in front by sorted_ops."""

    def __init__(self, dtype_bytes: int) -> None:
        self.dtype_bytes = dtype_bytes
        self.ops: list[FwdOp] = []

    def input(self, name: str, numel: int) -> int:
        self.ops.append(FwdOp(name=name, out_bytes=numel * self.dtype_bytes, phase=Phase.INPUT))
        return len(self.ops) - 1

    def param(self, name: str, numel: int) -> int:
        self.ops.append(FwdOp(name=name, out_bytes=numel * self.dtype_bytes, phase=Phase.PARAM))
        return len(self.ops) - 1

    def op(self, name: str, inputs: tuple[int, ...], numel: int, *, flops: float,
           grad_reads: tuple[int, ...] | str, grad_alias: bool = False) -> int:
        v = len(self.ops)
        out_bytes = numel * self.dtype_bytes
        moved = out_bytes + sum(self.ops[u].out_bytes for u in inputs)
        reads = (v,) if grad_reads == "self" else grad_reads
        self.ops.append(FwdOp(name=name, out_bytes=out_bytes, inputs=inputs,
                              compute_s=_roofline(flops, moved), grad_reads=reads,
                              grad_alias=grad_alias))
        return v

    def view(self, name: str, base: int) -> int:
        self.ops.append(FwdOp(name=name, out_bytes=self.ops[base].out_bytes, inputs=(base,),
                              alias_of=base, grad_alias=True))
        return len(self.ops) - 1

    def add(self, name: str, a: int, c: int) -> int:
        return self.op(name, (a, c), self.ops[a].out_bytes // self.dtype_bytes,
                       flops=self.ops[a].out_bytes // self.dtype_bytes, grad_reads=(), grad_alias=True)

    def linear(self, name: str, x: int, tokens: int, d_in: int, d_out: int) -> int:
        w = self.param(f"{name}_w", d_in * d_out)
        return self.op(name, (x, w), tokens * d_out, flops=2 * tokens * d_in * d_out, grad_reads=(x, w))

    def layernorm(self, name: str, x: int, tokens: int, d: int) -> int:
        g = self.param(f"{name}_g", d)
        return self.op(name, (x, g), tokens * d, flops=8 * tokens * d, grad_reads=(x, g))

    def conv(self, name: str, x: int, batch: int, c: int, r: int) -> int:
        c_in = self.ops[x].out_bytes // (self.dtype_bytes * batch * r * r)
        w = self.param(f"{name}_w", 9 * c_in * c)
        y = self.op(name, (x, w), batch * c * r * r, flops=2 * 9 * c_in * c * batch * r * r, grad_reads=(x, w))
        return self.op(f"{name}_relu", (y,), batch * c * r * r, flops=batch * c * r * r, grad_reads="self")

    def dropout(self, name: str, x: int) -> int:
        numel = self.ops[x].out_bytes // self.dtype_bytes
        self.ops.append(FwdOp(name=f"{name}_mask", out_bytes=numel, inputs=(), recomputable=False,
                              differentiable=False, compute_s=_roofline(numel, numel)))
        mask = len(self.ops) - 1
        return self.op(name, (x, mask), numel, flops=numel, grad_reads=(mask,))

    def sorted_ops(self) -> list[FwdOp]:
        return params_first(self.ops)


def params_first(ops: Sequence[FwdOp]) -> list[FwdOp]:
    """`ops` with PARAM/INPUT values moved in front (stable), indices remapped."""
    order = sorted(range(len(ops)), key=lambda i: ops[i].phase is Phase.FORWARD)
    new = {old: k for k, old in enumerate(order)}
    return [
        dataclasses.replace(
            ops[old],
            inputs=tuple(new[i] for i in ops[old].inputs),
            grad_reads=tuple(new[i] for i in ops[old].grad_reads),
            alias_of=None if ops[old].alias_of is None else new[ops[old].alias_of],
        )
        for old in order
    ]
