"""The CP-SAT model of simulate's canonical schedule, exact at every node step.

Time is the index of a node step: forward steps 0..F-1, backward nodes F..F+T-1 (the
recomputations before backward node t run "at" t; see below). Every quantity below is
what simulate.py computes for the canonical schedule:

  need_v   v's value is brought back in backward: a backward node reads v, or a
           RECOMPUTE child of v that is needed is recomputed (it reads v).
  rec_v    = RECOMPUTE and needed: v is recomputed once, costing compute_s.
  fn_v     the backward node before which v is first needed: the earliest of v's first
           backward reader and fn_c of its recomputed children c (simulate's depth-
           first bring-back reaches v exactly then).
  lr_v     the last node step at which v's backward instance is alive: its last
           backward reader (extended by backward views of it), and fn_c - 1 for each
           recomputed child c (the recomputation runs after step fn_c - 1 and reads v).

Storages (what bytes are counted once): the forward storage F_s of each plain decision
value s (alive from its forward step to its last forward use, or to lr of a saved
member of its alias group), the recompute storage R_s (alive from fn_s to the lr of the
instances that view it) and the reload storage L_u of an offloaded u. Each backward
instance binds to one of them (`bind`), as simulate's aliasing does. A Cumulative
constraint keeps static bytes (no decision changes them) plus live storages under the
budget at every node step.

Exactness: at node steps this is simulate's live set exactly. Inside a run of
recomputations before a backward node, simulate frees values as it goes, in depth-first
order; the model does not check those steps, so it is a *relaxation*: its optimum is a
lower bound, and a solution is only accepted once simulate confirms it fits (ilp.py adds
a no-good cut for each one that does not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ortools.sat.python import cp_model

from remat_solvers.ilp.data import model_data, runs
from remat_solvers.problem import Decision, Problem

MAX_KNAPSACKS = 1024
"""Most redundant knapsack rows added to the model (see CanonicalModel._knapsacks)."""
MAX_KNAPSACK_WORK = 400_000
"""Most rows x storages scanned to build them: building is pure Python, and 1,024 rows
over random_dag(10k)'s 2,450 storages took 5 s of a 10 s limit; fewer rows stay valid."""


class CanonicalModel:
    """Builds the model once; `solve` may be called again after `forbid`."""

    def __init__(self, problem: Problem, *, min_peak: bool = False, cumulative: bool = True) -> None:
        """min_peak: minimize the peak (the budget ignored) instead of the cost.
        cumulative=False: the knapsack rows alone bound the memory (a looser, much faster
        relaxation, which `strengthen` tightens; ilp.py's row generation)."""
        self.problem = problem
        self.min_peak = min_peak
        # (variable, how to compute it from already computed values): complete hints.
        self.defs: list[tuple[cp_model.IntVar, Callable[[Callable], int]]] = []
        self.data = model_data(problem)
        self.model = cp_model.CpModel()
        # CP-SAT deterministic seconds used and nominal seconds charged by the calls on
        # this model so far (clock.py: the next call's deterministic limit uses the ratio).
        self.cpsat_det_s, self.cpsat_charged_s = 0.0, 0.0
        costs = [problem.nodes[v].compute_s for v in self.data.decision]
        costs += [problem.nodes[v].save_s for v in self.data.decision]
        bw = problem.offload_bandwidth_bytes_per_s
        if bw:
            costs += [problem.transfer_s(v) for v in self.data.decision]
        self.scale = _scale(costs)
        self._decisions()
        self._demand()
        self._storages()
        self.cumulative = False
        if cumulative or min_peak:
            self.add_cumulative()
        if min_peak:
            self.model.minimize(self.peak)
        else:
            self._knapsacks()
            self._objective()

    # ---- variables: the decisions ----

    def _decisions(self) -> None:
        m, p = self.model, self.problem
        self.save, self.drop, self.off = {}, {}, {}
        for v in self.data.decision:
            allowed = p.allowed(v)
            self.save[v] = m.new_bool_var(f"save_{v}")
            self.drop[v] = m.new_bool_var(f"drop_{v}")
            lits = [self.save[v], self.drop[v]]
            if Decision.OFFLOAD in allowed:
                self.off[v] = m.new_bool_var(f"off_{v}")
                lits.append(self.off[v])
            # One decision per value.
            m.add_exactly_one(lits)

    # ---- variables and constraints: who is brought back when ----

    def _demand(self) -> None:
        m, d, nodes = self.model, self.data, self.problem.nodes
        big = d.n_steps
        self.need, self.rec, self.reload, self.fn, self.lr = {}, {}, {}, {}, {}
        for v in reversed(d.decision):
            # need_v: read by backward, or by the recomputation of a needed child.
            self.need[v] = m.new_bool_var(f"need_{v}")
            feeds = [self.rec[c] for c in d.children[v]]
            if v in d.first_read:
                m.add(self.need[v] == 1)
                self._def(self.need[v], lambda val: 1)
            elif feeds:
                m.add_max_equality(self.need[v], feeds)
                self._def(self.need[v], lambda val, f=feeds: max(val(x) for x in f))
            else:
                m.add(self.need[v] == 0)
                self._def(self.need[v], lambda val: 0)
            # rec_v / reload_v: dropped (offloaded) and needed.
            self.rec[v] = self._and(f"rec_{v}", self.drop[v], self.need[v])
            if v in self.off:
                self.reload[v] = self._and(f"reload_{v}", self.off[v], self.need[v])
            if not nodes[v].recomputable:
                m.add(self.rec[v] == 0)  # dropping it is valid only if nothing needs it
            # Symmetry: an unneeded value is saved (SAVE and RECOMPUTE are the same plan).
            m.add_implication(self.need[v].Not(), self.save[v])
            # fn_v: the earliest need (depth-first bring-back reaches v then).
            terms = [d.first_read[v]] if v in d.first_read else []
            for c in d.children[v]:
                t = m.new_int_var(0, big, f"fnterm_{v}_{c}")
                m.add(t == self.fn[c]).only_enforce_if(self.rec[c])
                m.add(t == big).only_enforce_if(self.rec[c].Not())
                self._def(t, lambda val, r=self.rec[c], f=self.fn[c]: val(f) if val(r) else big)
                terms.append(t)
            self.fn[v] = m.new_int_var(0, big, f"fn_{v}")
            m.add_min_equality(self.fn[v], terms or [big])
            self._def(self.fn[v], lambda val, ts=tuple(terms): min((val(t) for t in ts), default=big))
            # lr_v: last read of v's backward instance (a lower bound is enough: a
            # longer life only costs memory).
            self.lr[v] = m.new_int_var(-1, big, f"lr_{v}")
            if v in d.last_read:
                m.add(self.lr[v] >= d.last_read[v])
            for c in d.children[v]:
                m.add(self.lr[v] >= self.fn[c] - 1).only_enforce_if(self.rec[c])
            reads = tuple((self.rec[c], self.fn[c]) for c in d.children[v])
            self._def(self.lr[v], lambda val, rs=reads, last=d.last_read.get(v, -1):
                      max([last] + [val(f) - 1 for r, f in rs if val(r)]))

    # ---- storages and what binds to them ----

    def _storages(self) -> None:
        d, p = self.data, self.problem
        nodes, root = p.nodes, p.storage_of
        self.intervals: list[tuple[cp_model.IntervalVar, int]] = []
        self.bind: dict[int, dict[str, cp_model.IntVar]] = {}
        for v in d.decision:
            s = root[v]
            places: dict[str, list] = {}
            plain_storage = s in d.forward_end and nodes[s].out_bytes > 0
            if plain_storage:
                places.setdefault(f"F{s}", []).append(self.save[v])
            if nodes[v].alias_of is None:
                places.setdefault(f"R{v}", []).append(self.rec[v])
            else:
                for key, lit in self.bind.get(nodes[v].alias_of, {}).items():
                    places.setdefault(key, []).append(self._and(f"via_{v}_{key}", self.rec[v], lit))
            if v in self.reload:
                places[f"L{v}"] = [self.reload[v]]
            self.bind[v] = {key: self._or(f"bind_{v}_{key}", lits) for key, lits in places.items()}
        # A storage lives until the last read of every instance bound to it.
        readers: dict[str, list] = {}
        for v, places in self.bind.items():
            for key, lit in places.items():
                readers.setdefault(key, []).append((lit, self.lr[v]))
        for s, end in d.forward_end.items():
            if nodes[s].out_bytes > 0:
                self._storage(f"F{s}", d.step[s], end, None, nodes[s].out_bytes, readers)
        for v in d.decision:
            if nodes[v].alias_of is None and nodes[v].out_bytes > 0:
                self._storage(f"R{v}", self.fn[v], -1, self.rec[v], nodes[v].out_bytes, readers)
            if v in self.reload and nodes[v].out_bytes > 0:
                self._storage(f"L{v}", self.fn[v], -1, self.reload[v], nodes[v].out_bytes, readers)

    def _storage(self, key: str, start, lowest: int, present, size_bytes: int, readers: dict) -> None:
        """One storage's live interval, ending at the last read of what binds to it."""
        m = self.model
        end = m.new_int_var(lowest, self.data.n_steps - 1, f"end_{key}")
        for lit, lr in readers.get(key, ()):
            m.add(end >= lr).only_enforce_if(lit)
        self._def(end, lambda val, rs=tuple(readers.get(key, ())): max([lowest] + [val(lr) for lit, lr in rs if val(lit)]))
        self._interval(key, start, end, present, size_bytes)

    def _interval(self, key: str, start, end: cp_model.IntVar, present, size_bytes: int) -> None:
        m = self.model
        stop = m.new_int_var(0, self.data.n_steps, f"stop_{key}")
        m.add(stop == end + 1)
        self._def(stop, lambda val: val(end) + 1)
        length = m.new_int_var(0, self.data.n_steps, f"len_{key}")
        self._def(length, lambda val: max(0, val(stop) - val(start)) if present is None or val(present) else 0)
        if present is None:
            iv = m.new_interval_var(start, length, stop, f"live_{key}")
        else:
            iv = m.new_optional_interval_var(start, length, stop, present, f"live_{key}")
        self.intervals.append((iv, size_bytes))

    # ---- the budget at every node step ----

    def add_cumulative(self) -> None:
        """The exact node-step memory constraint (once); a model built without it is
        the knapsack rows' relaxation, which this turns into the full model."""
        if self.cumulative:
            return
        self.cumulative = True
        self.cpsat_det_s, self.cpsat_charged_s = 0.0, 0.0  # another model: earlier calls say nothing of its cost
        m, d = self.model, self.data
        base = min(d.static)
        capacity = self.problem.budget_bytes - base
        if self.min_peak:
            top = max(d.static) + sum(b for _, b in self.intervals)
            self.peak = m.new_int_var(max(d.static), top, "peak")
            capacity = self.peak - base
        intervals = [iv for iv, _ in self.intervals]
        demands = [b for _, b in self.intervals]
        k = 0
        while k < d.n_steps:  # static bytes as fixed intervals, one per run of equal values
            j = k
            while j + 1 < d.n_steps and d.static[j + 1] == d.static[k]:
                j += 1
            if d.static[k] > base:
                intervals.append(m.new_fixed_size_interval_var(k, j - k + 1, f"static_{k}"))
                demands.append(d.static[k] - base)
            k = j + 1
        if not self.min_peak and capacity < 0:
            m.add_bool_or([])  # the static bytes alone exceed the budget
        else:
            m.add_cumulative(intervals, demands, capacity)

    # ---- redundant linear cuts: they give CP-SAT's LP a useful bound ----

    def _knapsacks(self) -> None:
        """At node step t, every value read by backward in [first_v, last_v] around t is
        live whatever its decision; a value first read after t is live if saved; a value
        only recomputations read is live if saved and needed, until the earliest step a
        recomputation reading it can run (E_v, the earliest first read below it):
        a value first read after t is also live if a child read around t is recomputed
        (that pulled it back early): static_t + fixed_t + sum(bytes * live) <= budget.
        One constraint per distinct live set (at its tightest step)."""
        d, p = self.data, self.problem
        nodes, root = p.nodes, p.storage_of
        self._earliest = earliest = {}
        for v in reversed(d.decision):
            cands = [earliest[c] for c in d.children[v]]
            if v in d.first_read:
                cands.append(d.first_read[v])
            earliest[v] = min(cands, default=d.n_steps)
        self._groups = groups = {}
        for v in d.decision:
            s = root[v]
            if s in d.forward_end and nodes[s].out_bytes > 0:
                groups.setdefault(s, []).append(v)
        self._alive, self._by_memo, self._waits = {}, {}, {}
        self.strengthened: set[int] = set()
        tightest: dict[tuple, tuple[int, int]] = {}
        limit = min(MAX_KNAPSACKS, max(16, MAX_KNAPSACK_WORK // max(1, len(groups))))
        for t, top in runs(d, groups, earliest, limit):
            room, live = self._row(t, top)
            key = tuple(live)
            if key not in tightest or room < tightest[key][0]:
                tightest[key] = (room, t)
        for live, (room, _) in tightest.items():
            self._add_row(room, live)

    def strengthen(self, t: int) -> None:
        """The knapsack row of node step t, also counting values read after t that a
        chain of recomputations of any depth brought back by t (see _by), and saved
        values kept for a recomputation that runs after t (see _waiting): valid for
        every plan, added where a relaxed solution overflows (ilp.py's row generation).
        On a chain it counts exactly simulate's live bytes at t."""
        if t in self.strengthened:
            return
        self.strengthened.add(t)
        room, live = self._row(t, self.data.static[t], waits=True)
        self._add_row(room, live)

    def _row(self, t: int, top: int, waits: bool = False):
        """(room, live): the bytes left under the budget at node step t once static and
        fixed bytes are counted, and per storage that may be live, why."""
        d, p = self.data, self.problem
        nodes, earliest = p.nodes, self._earliest
        live, fixed = [], 0
        for s, vs in self._groups.items():
            if d.step[s] > t:
                continue
            if any(v in d.first_read and d.first_read[v] <= t <= d.last_read[v] for v in vs):
                fixed += 0 if self.off else nodes[s].out_bytes
                continue
            if t <= d.forward_end[s]:
                fixed += nodes[s].out_bytes
                continue
            later = tuple(v for v in vs if (d.first_read[v] > t if v in d.first_read else earliest[v] > t))
            # Pulled early: a child read around t that is recomputed brought a member
            # read after t back before t; it stays until that read.
            pulls = tuple(sorted({c for v in later if v in d.first_read for c in d.children[v]
                                  if c in d.first_read and d.first_read[c] <= t <= d.last_read[c]}))
            kept, brought = (), ()
            if waits:
                kept = tuple((v, c, t) for v in vs for c in d.children[v]
                             if not (c in d.first_read and d.first_read[c] <= t))
                # Brought back by t through a chain of recomputations (any depth).
                brought = tuple((v, t) for v in later if v in d.first_read)
            if later or kept:
                live.append((s, later, pulls, kept, brought))
        return p.budget_bytes - top - fixed, live

    def _add_row(self, room: int, live: list) -> None:
        terms = []
        for s, *why in live:
            why = tuple(why)
            if why not in self._alive:
                self._alive[why] = self._live_if_saved(s, *why)
            if self._alive[why] is not None:
                terms.append(self.problem.nodes[s].out_bytes * self._alive[why])
        if terms:
            self.model.add(sum(terms) <= room)

    def _waiting(self, v: int, c: int, t: int):
        """save_v, c recomputed, and c not yet brought back at node step t: its
        recomputation, after t, reads v's saved instance, which lives through t."""
        key = (v, c, t)
        if key not in self._waits:
            m = self.model
            z = m.new_bool_var(f"wait_{v}_{c}_{t}")
            by = self._by(c, t)
            early = () if by is None else (by,)  # None: c cannot be back by t
            m.add(z >= self.save[v] + self.rec[c] - sum(early) - 1)
            self._def(z, lambda val, a=self.save[v], b=self.rec[c], e=early:
                      val(a) * val(b) * (1 - sum(val(x) for x in e)))
            self._waits[key] = z
        return self._waits[key]

    def _by(self, c: int, t: int):
        """A literal equal to "c, first read after t (or never), is brought back by node
        step t" (fn_c <= t); None if no plan does that. That holds exactly when a
        recomputed child k is brought back by t: k read by then, or itself brought back
        by t."""
        key = (c, t)
        if key in self._by_memo:
            return self._by_memo[key]
        m, d = self.model, self.data
        reasons = []
        for k in d.children[c]:
            if self._earliest[k] > t:
                continue
            if k in d.first_read and d.first_read[k] <= t:
                reasons.append(self.rec[k])
                continue
            sub = self._by(k, t)
            if sub is None:
                continue
            q = m.new_bool_var(f"by_{c}_{t}_via_{k}")
            m.add_implication(q, self.rec[k])
            m.add_implication(q, sub)
            m.add_bool_or([self.rec[k].Not(), sub.Not(), q])
            self._def(q, lambda val, r=self.rec[k], f=self.fn[k]: int(bool(val(r)) and val(f) <= t))
            reasons.append(q)
        if not reasons:
            self._by_memo[key] = None
            return None
        e = m.new_bool_var(f"by_{c}_{t}")
        m.add_bool_or(reasons).only_enforce_if(e)
        for r in reasons:
            m.add_implication(r, e)
        self._def(e, lambda val, f=self.fn[c]: int(val(f) <= t))
        self._by_memo[key] = e
        return e

    def _live_if_saved(self, s: int, members: tuple[int, ...], pulls: tuple[int, ...] = (),
                       kept: tuple[tuple[int, int, int], ...] = (), brought: tuple[tuple[int, int], ...] = ()):
        """A literal that is true if the storage is live: a member read later is saved,
        or so is a view ancestor of it (a member recomputed later reads that ancestor's
        saved instance, in this same storage); for a member no backward node reads, the
        same once it is needed; or one of `pulls` (children already read) is
        recomputed, which brought a member back early; or a member read later was
        `brought` back by its step through a chain of recomputations; or a `kept` wait
        holds. None if nothing can keep it live."""
        m, d, nodes = self.model, self.data, self.problem.nodes
        lits = [self.drop[c] for c in pulls]
        for v in members:
            chain = [v]
            while nodes[chain[-1]].alias_of in self.save:
                chain.append(nodes[chain[-1]].alias_of)
            for j, x in enumerate(chain):
                # An ancestor's saved instance serves v only if v and the views between
                # are recomputed: an offloaded one is reloaded into a storage of its own.
                conds = [self.save[x]]
                if any(y in self.off for y in chain[:j]):
                    conds += [self.drop[y] for y in chain[:j]]
                if v not in d.first_read:
                    conds.append(self.need[v])
                if len(conds) == 1:
                    lits.append(conds[0])
                    continue
                z = m.new_bool_var(f"kept_{v}_{x}")
                m.add(z >= sum(conds) - (len(conds) - 1))
                self._def(z, lambda val, cs=tuple(conds): math.prod(val(c) for c in cs))
                lits.append(z)
        lits += [self._waiting(v, c, t) for v, c, t in kept]
        lits += [x for v, t in brought if (x := self._by(v, t)) is not None]
        lits = list(dict.fromkeys(lits))
        if not lits:
            return None
        if len(lits) == 1:
            return lits[0]
        y = m.new_bool_var(f"live_{s}_{len(self._alive)}")
        for lit in lits:
            m.add_implication(lit, y)
        self._def(y, lambda val, ls=tuple(lits): max(val(x) for x in ls))
        return y

    def _objective(self) -> None:
        p, s = self.problem, self.scale
        terms = [(round(p.nodes[v].compute_s * s), self.rec[v]) for v in self.data.decision]
        # what saving costs where the cost model charges it (Problem.save_charged)
        terms += [(round(save_s * s), self.save[v]) for v, save_s in p.save_charged]
        for v, off in self.off.items():  # the exposed part of each copy (Problem.store_s)
            terms += [(round(p.store_s(v) * s), off), (round(p.reload_s(v) * s), self.reload[v])]
        self.model.minimize(sum(c * x for c, x in terms if c))

    # ---- use ----

    def literal(self, v: int, d: Decision):
        return {Decision.SAVE: self.save, Decision.RECOMPUTE: self.drop, Decision.OFFLOAD: self.off}[d][v]

    def hint(self, decisions: Mapping[int, Decision]) -> None:
        """Hint every variable: the decisions and all they imply (a complete hint lets
        CP-SAT start from this plan at once)."""
        self.model.clear_hints()
        values = self.implied(decisions)
        for v in self.data.decision:
            for d in self.problem.allowed(v):
                lit = self.literal(v, d)
                self.model.add_hint(lit, values[lit.index])
        for var, _ in self.defs:
            self.model.add_hint(var, values[var.index])

    def implied(self, decisions: Mapping[int, Decision]) -> dict[int, int]:
        """The value of every variable (by index) that `decisions` imply."""
        decisions = self.canonical(decisions)
        values: dict[int, int] = {}
        for v in self.data.decision:
            for d in self.problem.allowed(v):
                values[self.literal(v, d).index] = int(decisions[v] is d)

        def val(x) -> int:
            return x if isinstance(x, int) else values[x.index]

        for var, rule in self.defs:
            values[var.index] = rule(val)
        return values

    def row_terms(self, t: int) -> tuple[int, list[tuple[int, cp_model.IntVar]]]:
        """Node step t's strengthened row (strengthening it if not yet) as the bytes it
        counts whatever the plan and (bytes, literal) per storage that may be live."""
        self.strengthen(t)
        room, live = self._row(t, self.data.static[t], waits=True)
        lits = [(self.problem.nodes[s].out_bytes, self._alive[tuple(why)]) for s, *why in live]
        return self.problem.budget_bytes - room, [(b, lit) for b, lit in lits if lit is not None]

    def row_bytes(self, decisions: Mapping[int, Decision]) -> list[int]:
        """Per node step, the live bytes its strengthened row counts under `decisions`
        (every step is strengthened first): at most simulate's live bytes at that step
        for every plan, and exactly those on chains (tests check both)."""
        rows = [self.row_terms(t) for t in range(self.data.n_steps)]
        values = self.implied(decisions)
        return [fixed + sum(b * values[lit.index] for b, lit in terms) for fixed, terms in rows]

    def canonical(self, decisions: Mapping[int, Decision]) -> dict[int, Decision]:
        """The same plan with every never-needed value SAVE (the model's symmetry
        breaking; SAVE and RECOMPUTE of such a value are the same schedule)."""
        d = self.data
        out = dict(decisions)
        rec: dict[int, bool] = {}
        for v in reversed(d.decision):
            need = v in d.first_read or any(rec[c] for c in d.children[v])
            rec[v] = need and out[v] is Decision.RECOMPUTE
            if not need:
                out[v] = Decision.SAVE
        return out

    def _def(self, var, rule) -> None:
        self.defs.append((var, rule))

    def _and(self, name: str, a, b):
        x = self.model.new_bool_var(name)
        self.model.add_bool_and([a, b]).only_enforce_if(x)
        self.model.add_bool_or([a.Not(), b.Not()]).only_enforce_if(x.Not())
        self._def(x, lambda val: val(a) * val(b))
        return x

    def _or(self, name: str, lits: list):
        if len(lits) == 1:
            return lits[0]
        x = self.model.new_bool_var(name)
        self.model.add_max_equality(x, lits)
        self._def(x, lambda val: max(val(y) for y in lits))
        return x

    def forbid(self, decisions: Mapping[int, Decision]) -> None:
        """A no-good: this exact plan does not fit (simulate says so)."""
        self.model.add_bool_or([self.literal(v, decisions[v]).Not() for v in self.data.decision])

    def decisions_of(self, solver: cp_model.CpSolver) -> dict[int, Decision]:
        out = {}
        for v in self.data.decision:
            for d in self.problem.allowed(v):
                if solver.boolean_value(self.literal(v, d)):
                    out[v] = d
        return out


def _scale(costs: list[float]) -> float:
    """A power of two that turns the largest cost into about 1e7 units: costs that are
    dyadic rationals (the tests' multiples of 1/8) stay exact; others round by at most
    half a unit each."""
    top = max((c for c in costs if c > 0), default=1.0)
    return 2.0 ** math.floor(math.log2(1e7 / top))
