"""Exact memory and cost of one block of a block sequence under one local configuration.

`dp` needs, for block b and each choice of its decisions, what the canonical schedule
(simulate.py) does during b's phases and what b leaves to the later blocks. This module
replays exactly that part of the schedule (the same depth-first recomputation order, the
same instance/storage lifetimes as `simulate`) on a local step list

    F_b forward steps | MID | cascade | POST | G_b backward steps (with recomputations) | END

where MID stands for all later phases before the suffix first needs a_b, "cascade" is
the recomputation (or reload) of a_b triggered there, POST stands for the rest of the
later phases, and END for the reads of a_{b-1} by block b-1. Bytes of the earlier
blocks enter as symbols: the constant K they keep (added by the caller) and, when
a_{b-1} is dropped, its own cascade summary (P, N, NR): the largest rise above the level
at which it starts, the rise just before a_{b-1}'s own step, and the rise left after
it. A result's peaks are max-plus forms `Terms` in these symbols.
"""

from __future__ import annotations

import copy
import dataclasses
from itertools import accumulate
from operator import add, itemgetter

# NEG and Terms are re-exported: fronts.py and the tests take them from here
from remat_solvers.dp.steps import (BWD, END, FWD, MID, NEG, NEST, NO_INSTANCE, POST, REC, REL, ROOT,  # noqa: F401
                              Instances, Terms, terms)
from remat_solvers.dp.structure import Block
from remat_solvers.problem import Decision, Phase, Problem


def save_charges(problem: Problem, block: Block) -> dict[int, float]:
    """{value of the block: `Node.save_s`} for the block's values a SAVE is charged for
    (Problem.save_charged: needed values with a save cost); empty without save costs."""
    inside = set(block.values)
    return {v: s for v, s in problem.save_charged if v in inside}


class InvalidLocal(Exception):
    """The configuration drops a non-recomputable value that is needed (a PlanError)."""


@dataclasses.dataclass(frozen=True)
class Local:
    """What block b does under one configuration and context."""

    cost_s: float
    """Recompute, transfer and save seconds (`Node.save_s` of SAVE values the backward
    reads) charged to this block's values."""
    peak_forward: int
    """Largest live bytes during F_b, static included, the earlier blocks' K excluded."""
    peak_backward: Terms
    """Largest live bytes during G_b (static included, K excluded)."""
    keep_bytes: int
    """Bytes of this block (and a_{b-1}) alive throughout the later blocks' phases."""
    prev_touched: bool
    """a_{b-1} is brought back (recomputed or reloaded) during this block's phases."""
    cascade: Terms | None
    """Summary P of recomputing a_b in the suffix (None: no such cascade)."""
    cascade_net: int = 0
    """Summary N (constant part): rise just before a_b's own recompute step."""
    cascade_nested: bool = False
    """The cascade recomputed a_{b-1} too (N and NR then include the incoming NR)."""
    cascade_freed: int = 0
    """Bytes freed right after a_b's recompute step (N - NR)."""


class BlockEvaluator:
    """Evaluates configurations of one block; configurations are tuples aligned with
    `block.values`."""

    def __init__(self, problem: Problem, block: Block, fixed: frozenset[int] = frozenset(),
                 prev_workspace: int | None = None) -> None:
        self.problem = problem
        self.block = block
        self.fixed = fixed
        """Decision values kept outside every block (structure.analyze's `fixed`):
        always on the device, counted in the static bytes."""
        self.prev_workspace = (problem.nodes[block.prev].workspace_bytes
                               if prev_workspace is None and block.prev is not None else prev_workspace or 0)
        """Workspace of a_{b-1}'s recomputation (its node's unless given): it enters only
        the n terms (the ROOT step), so tables.py evaluates with 0 and adds it after."""
        self.nodes = problem.nodes
        self.values = block.values
        self.local_roots = set(block.values)
        root = problem.storage_of
        self.fwd_local = [root[i] in self.local_roots for i in block.forward_steps]
        self.store_s = {v: problem.store_s(v) for v in block.values}
        self.reload_s = {v: problem.reload_s(v) for v in block.values}
        self.save_s = save_charges(problem, block)
        """What SAVE of each charged value of the block costs (Problem.save_charged): a
        cost of the configuration alone (a_{b-1}'s is its own block's), like simulate's."""
        self.fwd_steps = tuple((FWD, f, s) for f, s in zip(block.forward_steps, block.static_forward))
        self.fwd_instances = self._forward_instances()
        # Per node whose inputs a run examines (recomputed values, backward steps): the
        # inputs that may be off the device (forward, not fixed: a fixed value is always
        # on it) and those that may have a local instance (the replay ignores the rest).
        # Filtering once here keeps the hot loops to the inputs that matter.
        tracked = set(self.fwd_instances.newest) | self.local_roots
        self.fwd_inputs: dict[int, tuple[int, ...]] = {}
        self.reads: dict[int, tuple[int, ...]] = {}
        for i in (*block.values, *block.backward_steps):
            inputs = self.nodes[i].inputs
            self.fwd_inputs[i] = tuple(j for j in inputs if self.nodes[j].phase is Phase.FORWARD and j not in fixed)
            self.reads[i] = tuple(j for j in inputs if j in tracked)
        # Most backward steps read no forward value (GPT-2: 35 of 47, LLaMA: 78 of 90):
        # they bring nothing back and touch no instance, so runs add them in bulk: each
        # reading step with the inert steps before it, then the inert tail.
        self.g_plan: list[tuple[tuple, int, int, int]] = []
        inert: list[tuple[int, int, int]] = []
        for r, at, before in zip(block.backward_steps, block.static_backward, block.static_before):
            if self.fwd_inputs[r] or self.reads[r]:
                self.g_plan.append((tuple(inert), r, at, before))
                inert = []
            else:
                inert.append((BWD, r, at))
        self.g_tail = tuple(inert)

    def _forward_instances(self) -> Instances:
        """Instances and storages after F_b's steps. Forward reads bind to forward
        instances whatever the configuration, so this prefix of every run's `lifetimes`
        is built once (runs copy it: the backward part extends its instances)."""
        nodes, prev = self.nodes, self.block.prev
        st = Instances()
        if prev is not None:  # its forward instance: alive from the start while read
            st.new(prev, 0, nodes[prev].out_bytes)
            st.inst_end[0] = -1
        for k, i in enumerate(self.block.forward_steps):
            for j in nodes[i].inputs:
                st.read(j, k)
            if self.fwd_local[k]:
                node = nodes[i]
                if node.alias_of is None:
                    st.new(i, k, node.out_bytes)
                else:
                    st.view(i, node.alias_of, k)
        return st

    def evaluate(self, config: tuple[Decision, ...], mode_prev: Decision | None, delta: bool) -> Local:
        """Raises InvalidLocal for a configuration simulate would reject."""
        run = _Run(self, dict(zip(self.values, config)), mode_prev)
        steps = run.build(delta)
        level = run.levels(steps, delta)
        return run.summarize(steps, level, delta)

    def evaluate_modes(self, config: tuple[Decision, ...], modes_prev: tuple, delta: bool) -> dict:
        """{mode of a_{b-1}: evaluate(config, mode, delta), or the InvalidLocal it raises}
        for every mode, replaying as few runs as possible. The modes differ only where
        a_{b-1} is met: a dropped one is brought back there (its own steps, then on the
        device), a saved one is on the device already, and every other step is the same.
        So a run that raises for another value raises in every mode; a run in which a
        dropped a_{b-1} is never brought back (not touched) serves every dropped mode,
        and SAVE too (_held); a touched run gives SAVE's run without a_{b-1}'s steps
        (_saved)."""
        dropped = [m for m in modes_prev if m in (Decision.RECOMPUTE, Decision.OFFLOAD)]
        out: dict = {}
        if self.block.prev is not None and dropped:
            run = _Run(self, dict(zip(self.values, config)), dropped[0])
            try:
                steps = run.build(delta)
            except InvalidLocal as error:
                # kept in tables: without its traceback, whose frames (up to the caller's:
                # a compile under torch.compile) would keep their locals alive
                error = error.with_traceback(None)
                out[dropped[0]] = error
                if error.args[0] != self.block.prev:
                    out.update((m, error) for m in modes_prev)
            else:
                level = run.levels(steps, delta)
                local = run.summarize(steps, level, delta)
                out[dropped[0]] = local
                if not local.prev_touched:
                    out.update((m, local) for m in dropped)
                    if Decision.SAVE in modes_prev:
                        out[Decision.SAVE] = self._held(run, steps, level, delta, local)
                elif Decision.SAVE in modes_prev:
                    out[Decision.SAVE] = self._saved(run, steps, level, delta)
        for mode in modes_prev:
            if mode not in out:
                try:
                    out[mode] = self.evaluate(config, mode, delta)
                except InvalidLocal as error:
                    out[mode] = error.with_traceback(None)
        return out

    def _held(self, run: _Run, steps: list, level: list[int], delta: bool, local: Local) -> Local:
        """The SAVE run's Local from an untouched dropped run (evaluate_modes)."""
        if not self.block.prev_read_later:
            return local  # no END step: the same steps and lifetimes
        size = self.nodes[self.block.prev].out_bytes
        end = self.fwd_instances.inst_end[0]  # a_{b-1}'s forward instance: its last F_b read
        held = [x + size if k > end else x for k, x in enumerate(level)]
        held.append(size)  # END: only a_{b-1}'s storage is read there
        return run.summarize([*steps, (END, self.block.prev, 0)], held, delta)

    def _saved(self, run: _Run, steps: list, level: list[int], delta: bool) -> Local:
        """The SAVE run's Local from a RECOMPUTE run that brought a_{b-1} back at step a
        (NEST, ROOT; RECOMPUTE is always the first dropped mode: Problem.allowed): the
        same steps without those two, and the same storages except a_{b-1}'s. The
        dropped run holds its forward instance [0, e0] (last F_b read) and the
        brought-back one [a + 1, e1] (every later read binds to it); the SAVE run holds
        one storage from 0 to its last read, max(e0, e1 - 2) after the removal. So its
        live bytes are the dropped run's plus a_{b-1} on (e0, a) when it is read after
        being brought back, and equal elsewhere."""
        a, r = run.prev_at, 2
        assert steps[a][0] == NEST and run.mode_prev is Decision.RECOMPUTE
        inst = run.instances
        e0, e1 = inst.inst_end[0], inst.inst_end[inst.newest[self.block.prev]]
        held = level[:a] + level[a + r:]
        if e1 > a + 1:
            size = self.nodes[self.block.prev].out_bytes
            for k in range(e0 + 1, a):
                held[k] += size
        saved = copy.copy(run)
        saved.touched = False

        def moved(k: int) -> int:
            return k - r if k >= a + r else min(k, a)

        saved.mid, saved.post, saved.g_start = moved(run.mid), moved(run.post), moved(run.g_start)
        saved.cascade = (moved(run.cascade[0]), moved(run.cascade[1]))
        return saved.summarize(steps[:a] + steps[a + r:], held, delta)


class _Run:
    """One replay of the local step list."""

    def __init__(self, ev: BlockEvaluator, dec: dict[int, Decision], mode_prev: Decision | None) -> None:
        self.ev = ev
        self.nodes = ev.nodes
        self.dec = dec
        self.prev = ev.block.prev
        self.boundary = ev.block.boundary
        self.mode_prev = mode_prev
        # fixed values are on the device too, but no run asks: ev.fwd_inputs leaves them out
        self.on_device = {v for v, d in dec.items() if d is Decision.SAVE}
        if self.prev is not None and mode_prev is Decision.SAVE:
            self.on_device.add(self.prev)
        self.cost_s = sum(ev.store_s[v] for v, d in dec.items() if d is Decision.OFFLOAD)
        if ev.save_s:
            self.cost_s += sum(s for v, s in ev.save_s.items() if dec[v] is Decision.SAVE)
        self.touched = False
        self.mid = self.post = -1
        self.cascade = (0, 0)

    def build(self, delta: bool) -> list[tuple[int, int, int]]:
        """The local step list: (kind, node id, static bytes)."""
        block = self.ev.block
        steps = list(self.ev.fwd_steps)
        self.active: list[int] = []  # the steps after F_b that read or make an instance
        if self.boundary is not None:
            self.mid = len(steps)
            self.active.append(self.mid)
            steps.append((MID, self.boundary, 0))
            if delta and self.dec[self.boundary] is not Decision.SAVE:
                self.bring_back(self.boundary, 0, steps)
            self.cascade = (self.mid + 1, len(steps))
            self.post = len(steps)
            if delta:
                self.active.append(self.post)
            steps.append((POST, self.boundary, 0))
        self.g_start = len(steps)
        fwd_inputs, on_device = self.ev.fwd_inputs, self.on_device
        for inert, r, at, before in self.ev.g_plan:
            steps.extend(inert)
            for j in fwd_inputs[r]:
                if j not in on_device:
                    self.bring_back(j, before, steps)
            self.active.append(len(steps))
            steps.append((BWD, r, at))
        steps.extend(self.ev.g_tail)
        if self.prev is not None and block.prev_read_later and self.prev in self.on_device:
            self.active.append(len(steps))
            steps.append((END, self.prev, 0))
        return steps

    def bring_back(self, root: int, static: int, steps: list[tuple[int, int, int]]) -> None:
        """simulate._bring_back, with a_{b-1} as an opaque (nested) cascade."""
        nodes, on_device, dec, fwd_inputs = self.nodes, self.on_device, self.dec, self.ev.fwd_inputs
        active = self.active
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if i in on_device:
                continue
            if i == self.prev:
                self.touched = True
                self.prev_at = len(steps)
                on_device.add(i)
                if self.mode_prev is Decision.OFFLOAD:
                    active.append(len(steps))
                    steps.append((REL, i, static))
                    continue
                if not nodes[i].recomputable:
                    raise InvalidLocal(i)
                steps.append((NEST, i, static))
                active.append(len(steps))
                steps.append((ROOT, i, static + self.ev.prev_workspace))
                continue
            d = dec[i]
            if d is Decision.OFFLOAD:
                active.append(len(steps))
                steps.append((REL, i, static))
                self.cost_s += self.ev.reload_s[i]
                on_device.add(i)
                continue
            if not nodes[i].recomputable:
                raise InvalidLocal(i)
            if expanded:
                active.append(len(steps))
                steps.append((REC, i, static + nodes[i].workspace_bytes))
                self.cost_s += nodes[i].compute_s
                on_device.add(i)
                continue
            stack.append((i, True))
            for j in reversed(fwd_inputs[i]):
                if j not in on_device:
                    stack.append((j, False))

    def levels(self, steps: list[tuple[int, int, int]], delta: bool) -> list[int]:
        """Local live bytes at each step (simulate._live_bytes restricted to this block's
        storages and a_{b-1}; a_b is left out between MID and POST, where block b+1
        counts it)."""
        st = self.lifetimes(steps, delta)
        end = [-1] * len(st.s_bytes)  # a storage lives until its last instance does
        for s, e in zip(st.inst_storage, st.inst_end):
            if e > end[s]:
                end[s] = e
        diff = [0] * (len(steps) + 1)
        for size, a, e, owner in zip(st.s_bytes, st.s_start, end, st.s_owner):
            if not size or e < a:
                continue
            diff[a] += size
            diff[e + 1] -= size
            if owner == self.boundary and self.mid >= 0:
                lo, hi = max(a, self.mid), min(e, self.post)
                if lo <= hi:
                    diff[lo] -= size
                    diff[hi + 1] += size
        diff.pop()
        return list(accumulate(diff))

    def lifetimes(self, steps: list[tuple[int, int, int]], delta: bool) -> Instances:
        """Every local instance and storage, each instance ending at its last read.
        F_b's part is the evaluator's `fwd_instances`; the loop below is the rest (the
        hot loop of table building: reads inlined, only the `active` steps (the others
        neither read nor make an instance), and since steps only advance, a read at step
        k is the instance's latest so far)."""
        nodes, reads = self.nodes, self.ev.reads
        st = self.ev.fwd_instances.copy()
        newest, inst_end, inst_storage = st.newest, st.inst_end, st.inst_storage
        s_bytes, s_start, s_owner = st.s_bytes, st.s_start, st.s_owner
        for k in self.active:
            kind, i, _ = steps[k]
            if kind == REC or kind == BWD:
                for j in reads[i]:
                    inst = newest.get(j)
                    if inst is not None:
                        inst_end[inst] = k
            elif kind == MID or kind == END or kind == POST and delta:
                inst = newest.get(i)
                if inst is not None:
                    inst_end[inst] = k
            if kind in NO_INSTANCE:
                continue
            node = nodes[i]
            if node.alias_of is None or kind == REL:  # st.new, inlined
                newest[i] = len(inst_storage)
                inst_storage.append(len(s_bytes))
                inst_end.append(k)
                s_bytes.append(node.out_bytes)
                s_start.append(k)
                s_owner.append(i)
            else:
                st.view(i, node.alias_of, k)
        self.instances = st
        return st

    def summarize(self, steps: list[tuple[int, int, int]], level: list[int], delta: bool) -> Local:
        n_fwd = len(self.ev.fwd_steps)
        value = list(map(add, map(itemgetter(2), steps), level))  # static + local bytes per step
        peak_forward = max(value[:n_fwd])
        keep = level[self.mid] if self.mid >= 0 else 0
        # a_{b-1}'s nested cascade: NEST (the P step) then ROOT (the N step)
        nest = self.prev_at if self.touched and steps[self.prev_at][0] == NEST else -1
        lo, hi = self.cascade
        cascade, net, freed, nested = None, 0, 0, False
        if hi > lo and self.dec[self.boundary] is Decision.RECOMPUTE:
            root = hi - 1  # a_b's own recompute step closes the cascade
            nested = lo <= nest < root
            cascade = terms(value, lo, root, nest if nested else -1, "c", -keep)
            net = level[root] - keep
            freed = level[root] - level[self.post]
        end = len(steps) - (steps[-1][0] == END)  # END is the last step, if any
        backward = terms(value, self.g_start, end, nest if nest >= self.g_start else -1,
                          "nr" if nested else "c", 0)
        return Local(
            cost_s=self.cost_s,
            peak_forward=peak_forward,
            peak_backward=backward,
            keep_bytes=keep,
            prev_touched=self.touched,
            cascade=cascade,
            cascade_net=net,
            cascade_nested=nested,
            cascade_freed=freed,
        )
