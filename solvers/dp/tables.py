"""dp's block tables: every configuration of a block evaluated (local.py) and Pareto-pruned
per context, shared between identical blocks, kept across solves and on disk.

A table maps a context (mode of a_{b-1}, a_{b-1} brought back in block b) to the options
(configuration, Local) no other option of the same outcome key dominates. Identical
blocks (same `_signature`: a layer deep in a stack differs from the first only by
constant static bytes) share one table.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from remat_solvers.base import WorkClock
from remat_solvers.dp import fronts, table_cache
from remat_solvers.dp.configs import doomed_test, enumerate_configs
from remat_solvers.dp.exchange import save_instead_mask
from remat_solvers.dp.fronts import DROPPED, Option
from remat_solvers.dp.local import BlockEvaluator, InvalidLocal, Local, save_charges
from remat_solvers.dp.structure import Block, BlockSequence
from remat_solvers.problem import Problem
from remat_solvers.registry import UnsupportedProblem


def block_tables(problem: Problem, seq: BlockSequence, limit: int, clock: WorkClock | None = None,
                 fixed: frozenset[int] = frozenset()) -> list[tuple[dict, tuple[int, int]]]:
    """For each block: context (mode of a_{b-1}, a_{b-1} brought back in block b) ->
    Pareto-pruned options. Identical blocks (same signature) share one table; blocks
    with the same canonical form (`_Form`) are tabulated in one pass."""
    clock = clock or WorkClock(None)
    forms = [_Form.of(problem, block) for block in seq.blocks]
    by_canon: dict[tuple, list[_Form]] = {}
    for form in forms:
        by_canon.setdefault(form.canon_sig, []).append(form)
    pending: dict[tuple, Entry] = {}  # tables of later blocks built with an earlier one's
    cache: dict[tuple, dict] = {}
    out = []
    for form in forms:
        if form.sig not in cache:
            later = [f for f in by_canon[form.canon_sig] if f.block.index > form.block.index]
            cache[form.sig] = _shared_table(problem, form, later, limit, clock, fixed, pending)
        out.append((cache[form.sig], form.offsets))
    return out


Entry = tuple[dict, int, int]
"""(compiled table, configurations enumerated, clock steps charged per configuration)."""

_TABLES: OrderedDict[tuple, Entry] = OrderedDict()
"""Tables of recent solves by (signature, limit), with what building them charged: a
budget sweep or a re-plan of the same model builds each table once. The signature holds
everything a table depends on (values read from outside the block are either fixed or
never brought back, and the evaluator treats both alike). Large tables are also kept
on disk across processes (table_cache)."""
_TABLES_KEPT = 32


@dataclasses.dataclass(frozen=True)
class _Shift:
    """How a block's Locals follow from its canonical form's (`_Form`): the forward
    peak moves by `forward_shift` and is at least `forward_floor` (the stripped
    prefix's peak; None: no prefix), and a_{b-1}'s recompute workspace adds to the n
    terms (its ROOT step is the only place it enters: local.py)."""

    forward_shift: int = 0
    forward_floor: int | None = None
    workspace: int = 0

    def vector(self, vec: tuple[float, ...]) -> tuple[float, ...]:
        """_option_vector of the shifted Local, from the canonical one's."""
        pf = vec[1] + self.forward_shift
        if self.forward_floor is not None:
            pf = max(self.forward_floor, pf)
        w = self.workspace
        out = (vec[0], pf, vec[2], vec[3], vec[4] + w if w else vec[4], *vec[5:])
        if w and len(out) > 7:
            out = (*out[:9], out[9] + w, *out[10:])
        return out

    def local(self, loc: Local) -> Local:
        if self == _IDENTITY:
            return loc
        pf = loc.peak_forward + self.forward_shift
        if self.forward_floor is not None:
            pf = max(self.forward_floor, pf)
        w = self.workspace
        back, casc = loc.peak_backward, loc.cascade
        if w:
            back = dataclasses.replace(back, n=back.n + w)
            casc = None if casc is None else dataclasses.replace(casc, n=casc.n + w)
        return dataclasses.replace(loc, peak_forward=pf, peak_backward=back, cascade=casc)


_IDENTITY = _Shift()


@dataclasses.dataclass(frozen=True)
class _Form:
    """A block (static bytes relative, `_relative`), its signature, and its canonical
    form: the leading forward steps that neither read a_{b-1} nor make a local storage
    stripped, the rest's static bytes shifted to start at 0, a_{b-1}'s workspace set to
    0. Why the Locals then follow by `shift`: the stripped steps read and make nothing
    the replay tracks, so every later step sees the same instances; at each of them only
    a_{b-1}'s forward storage is live (from step 0 to its first read, which comes
    after: required), so they add max(static) + bytes(a_{b-1}) to the forward peak's
    maximum and nothing else. GPT-2's layer 0 (a_{b-1}: the embedding dropout's replay,
    32,780 B of workspace) and LLaMA's (27 steps building the mask and rotary tables
    first) then share the other layers' canonical form: one pass tabulates both."""

    block: Block
    offsets: tuple[int, int]
    sig: tuple
    canon: Block
    canon_sig: tuple
    shift: _Shift

    @staticmethod
    def of(problem: Problem, block: Block) -> _Form:
        rel, offsets = _relative(block)
        nodes, root, prev = problem.nodes, problem.storage_of, rel.prev
        local = set(rel.values)
        steps = rel.forward_steps
        cut = 0
        while cut < len(steps) and root[steps[cut]] not in local and prev not in nodes[steps[cut]].inputs:
            cut += 1
        if cut == len(steps) or prev is not None and not any(prev in nodes[i].inputs for i in steps[cut:]):
            cut = 0  # nothing left, or a_{b-1}'s forward storage may not be live over the prefix
        rest = rel.static_forward[cut:]
        low = min(rest)
        floor = None
        if cut:
            floor = max(rel.static_forward[:cut]) + (nodes[prev].out_bytes if prev is not None else 0)
        workspace = nodes[prev].workspace_bytes if prev is not None else 0
        canon = dataclasses.replace(rel, forward_steps=steps[cut:], static_forward=tuple(x - low for x in rest))
        return _Form(block=rel, offsets=offsets, sig=_signature(problem, rel), canon=canon,
                     canon_sig=_signature(problem, canon, prev_workspace=0),
                     shift=_Shift(forward_shift=low, forward_floor=floor, workspace=workspace))


def _shared_table(problem: Problem, form: _Form, later: list[_Form], limit: int, clock: WorkClock,
                  fixed: frozenset[int], pending: dict[tuple, Entry]) -> dict:
    """The block's table: built with an earlier block's (`pending`), from this process's
    recent solves, else from the disk cache (table_cache), else built (and stored in
    both) in one pass with the tables of the `later` blocks of the same canonical form
    that are nowhere yet (left in `pending`)."""
    hit = pending.pop(form.sig, None) or _cached(form.sig, limit)
    if hit is None:
        targets = {form.sig: form.shift}
        for f in later:
            if f.sig not in targets and f.sig not in pending and _cached(f.sig, limit) is None:
                targets[f.sig] = f.shift
        tables, n_configs = _table(problem, form.canon, list(targets.values()), limit, clock, fixed)
        modes_prev = problem.allowed(form.block.prev) if form.block.prev is not None else (None,)
        steps = len(modes_prev) * len(form.block.values)
        for sig, raw in zip(targets, tables):
            entry = (fronts.compile_table(raw), n_configs, steps)
            table_cache.store(sig, limit, entry)
            _remember((sig, limit), entry)
            pending[sig] = entry
        return pending.pop(form.sig)[0]
    table, n_configs, steps = hit
    _charge(clock, form.block.index, n_configs, steps)  # as building it did: same plans, same limits
    return table


def _charge(clock: WorkClock, index: int, n_configs: int, steps: int) -> None:
    """Charge a table's work (`steps` per configuration: one local evaluation per context
    of a_{b-1}, each about the block's size) all at once, before building it: a table the
    limit cannot pay for is declined without being built (a cut midway wasted up to the
    whole limit of evaluations, in every solve that tried it), and its charge is left out
    of the work reported (a caller such as the ILP's warm start keeps the rest of its time)."""
    if not clock.affords_table_steps(n_configs * steps):
        raise UnsupportedProblem(f"dp: time limit reached while tabulating block {index} "
                                 f"({n_configs} configurations); raise time_limit_s or use 'ilp'",
                                 work_s=clock.spent_s)
    clock.charge_table_steps(n_configs * steps)


def _cached(sig: tuple, limit: int) -> Entry | None:
    """The table of `sig` from this process's recent solves or from disk (remembered)."""
    key = (sig, limit)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    hit = table_cache.load(sig, limit)
    if hit is not None:
        _remember(key, hit)
    return hit


def _remember(key: tuple, entry: Entry) -> None:
    _TABLES[key] = entry
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)


def _relative(block: Block) -> tuple[Block, tuple[int, int]]:
    """The block with its static bytes shifted to start at 0 in each phase, and the
    shifts (a layer deep in a stack differs from the first one only by these)."""
    off_f = min(block.static_forward)
    off_g = min(block.static_backward + block.static_before, default=0)
    rel = dataclasses.replace(
        block,
        static_forward=tuple(s - off_f for s in block.static_forward),
        static_backward=tuple(s - off_g for s in block.static_backward),
        static_before=tuple(s - off_g for s in block.static_before),
    )
    return rel, (off_f, off_g)


def _table(problem: Problem, block: Block, shifts: list[_Shift], limit: int, clock: WorkClock,
           fixed: frozenset[int] = frozenset()) -> tuple[list[dict], int]:
    """One table per shift of the (canonical) block's Locals: Pareto-pruned options per
    context; and how many configurations. Options are pruned on their shifted vectors
    and only the kept ones get a shifted Local."""
    evaluator = BlockEvaluator(problem, block, fixed, prev_workspace=0)
    configs = enumerate_configs(problem, block, limit)
    modes_prev = problem.allowed(block.prev) if block.prev is not None else (None,)
    _charge(clock, block.index, len(configs), len(modes_prev) * len(block.values))
    doomed = doomed_test(problem, block)
    worse = save_instead_mask(problem, block, configs)
    groups: list[dict[tuple, list]] = [{} for _ in shifts]
    for k, config in enumerate(configs):
        if doomed(config):
            continue  # every replay raises InvalidLocal: no option
        if worse[k]:
            continue  # saving one value instead is no worse in any component: no option kept
        mode_b = config[-1] if block.boundary is not None else None
        deltas = (False, True) if mode_b in DROPPED else (False,)
        by_delta = {delta: evaluator.evaluate_modes(config, modes_prev, delta) for delta in deltas}
        for mode_prev in modes_prev:
            for delta in deltas:
                local = by_delta[delta][mode_prev]
                if isinstance(local, InvalidLocal):
                    continue
                touched = local.prev_touched if mode_prev in DROPPED else False
                opt = Option(config, local, mode_b, delta)
                vec = _option_vector(opt)
                group = (mode_prev, touched, mode_b, delta, local.cascade_nested)
                for shift, by_group in zip(shifts, groups):
                    by_group.setdefault(group, []).append((shift.vector(vec), opt))
    tables = []
    for shift, by_group in zip(shifts, groups):
        table: dict[tuple, list[Option]] = {}
        for (mode_prev, touched, *_), items in by_group.items():
            kept = _prune_vectors([v for v, _ in items])
            table.setdefault((mode_prev, touched), []).extend(
                dataclasses.replace(items[k][1], local=shift.local(items[k][1].local)) for k in kept)
        tables.append(table)
    return tables, len(configs)


def _option_vector(opt: Option) -> tuple[float, ...]:
    loc = opt.local
    g, c = loc.peak_backward, loc.cascade
    vec = (loc.cost_s, loc.peak_forward, g.c, g.p, g.n, g.nr, loc.keep_bytes)
    if c is not None:
        vec += (c.c, c.p, c.n, c.nr, loc.cascade_net, loc.cascade_net - loc.cascade_freed)
    return vec


def _prune_options(opts: list[Option]) -> list[Option]:
    """Drop options dominated in every component (same context and outcome key)."""
    return [opts[k] for k in _prune_vectors([_option_vector(o) for o in opts])]


def _prune_vectors(vecs: list[tuple[float, ...]]) -> list[int]:
    """Indices of the vectors kept, in increasing (stable) order of the vectors: each is
    kept unless an earlier one weakly dominates it (so of equal vectors the first).
    fronts.pareto computes exactly that set (only an equal vector can weakly dominate an
    earlier one; of equal rows it keeps the first in that order); a pairwise loop costs
    ~10% of table building (GPT-2's attention groups keep thousands of options).
    Vectors are ints below 2**53 and floats, exact in float64."""
    order = sorted(range(len(vecs)), key=vecs.__getitem__)
    if len(vecs) < 2 or len({len(v) for v in vecs}) != 1:
        return [order[k] for k in _prune_plain([vecs[k] for k in order])]
    kept = fronts.pareto(np.array([vecs[k] for k in order], dtype=float))
    return [order[k] for k in sorted(kept.tolist())]


def _prune_plain(vecs: list[tuple[float, ...]]) -> list[int]:
    """_prune_vectors on vectors already in order, pairwise (the reference; and for
    vectors of unequal lengths, which never share an outcome key in practice)."""
    kept: list[int] = []
    for k, vec in enumerate(vecs):
        if not any(all(a <= b for a, b in zip(vecs[j], vec)) for j in kept):
            kept.append(k)
    return kept


def _signature(problem: Problem, block: Block, prev_workspace: int | None = None) -> tuple:
    """Everything the block's table depends on, with node ids relabeled locally and the
    static bytes as given (identical layers of a stack share their table); a_{b-1}'s
    workspace is its node's unless given."""
    nodes = problem.nodes
    local: dict[int, int] = {}
    if block.prev is not None:
        local[block.prev] = -1
    items = []
    for i in block.forward_steps + block.backward_steps:
        local[i] = len(local)
        n = nodes[i]
        items.append((n.phase, n.out_bytes, n.workspace_bytes, n.compute_s, n.recomputable, n.offloadable,
                      local.get(n.alias_of, None if n.alias_of is None else "x"),
                      tuple(local.get(j, "x") for j in n.inputs)))
    prev = None
    if block.prev is not None:
        p = nodes[block.prev]
        workspace = p.workspace_bytes if prev_workspace is None else prev_workspace
        prev = (p.out_bytes, workspace, p.recomputable, p.offloadable, block.prev_read_later)
    # store_s depends on the forward compute after a value, so identical layers at
    # different depths may price an offload differently
    store = tuple(problem.store_s(v) for v in block.values) if problem.offload_bandwidth_bytes_per_s else ()
    sig = (tuple(items), prev, block.boundary is None, problem.offload_bandwidth_bytes_per_s, store,
           block.static_forward, block.static_backward, block.static_before,
           tuple(local.get(v) for v in block.values))
    # what SAVE costs per value (Local.cost_s, and the pruning rules' gates); left out
    # without save costs, so those signatures are unchanged
    charge = save_charges(problem, block)
    return (*sig, tuple(charge.get(v, 0.0) for v in block.values)) if charge else sig


