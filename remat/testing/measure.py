"""Measure the memory of one training step: peak and end bytes of live tensor storage.

Three instruments, one result type (`MemoryMeasurement`):

- ``"dispatch"`` (`LiveBytesTracker`): a `TorchDispatchMode` that sees every ATen op,
  forward and backward (the autograd engine carries the mode into backward), and puts a
  weakref finalizer on each new storage, so a storage leaves the count the moment its
  last reference dies. Each storage is counted once (views share it). Exact and
  repeatable on CPU. Caveat (measured, torch 2.13): while any dispatch mode is active,
  `at::isTensorSubclassLike` is true for every tensor, so autograd accumulates the
  gradients of a value used twice out of place (``add``) instead of in place (``add_``).
  That can add one transient gradient-sized buffer to the peak of eager autograd code
  compared with an unobserved run; see `measure_step_profiler` for an unperturbed view.
- ``"profiler"`` (`measure_step_profiler`): the profiler's raw allocator events
  (``profile_memory=True``), summed in time order. Does not change what runs and works
  under ``torch.compile`` (where a dispatch mode makes dynamo fall back to eager). It also
  sees op-internal workspace that never becomes a tensor. It cannot see frees of storage
  allocated before the step.
- ``"cuda"``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

Budget semantics: everything live on the device counts — parameters, buffers, inputs,
existing gradients (register them), activations, temporaries and new gradients — like
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten

from remat import compat
from remat.compat import TorchDispatchMode, is_fake

log = logging.getLogger(__name__)

INSTRUMENTS = ("auto", "dispatch", "profiler", "cuda")

def _fresh_ops() -> frozenset[Any]:
    ops = []
    for name in ("lift_fresh", "lift_fresh_copy", "lift"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.extend(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


_FRESH_OPS = _fresh_ops()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelinePoint:
    """Live bytes right after one op returned (its outputs allocated, nothing freed yet)."""

    op: str
    """The op, e.g. ``"aten.mm.default"``."""
    live_bytes: int
    """Bytes of live storage on the tracked device at that moment."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryMeasurement:
    """Memory of one measured step."""

    peak_bytes: int
    """Largest number of live bytes at any moment, baseline included."""
    end_bytes: int
    """Live bytes when the step returned (its return value still referenced)."""
    baseline_bytes: int
    """Live bytes of the registered (pre-existing) tensors when the step started."""
    instrument: str
    """Which instrument measured it: "dispatch", "profiler" or "cuda"."""
    timeline: tuple[TimelinePoint, ...] = ()
    """Live bytes after each op (dispatch instrument with ``timeline=True`` only)."""

    def __post_init__(self) -> None:
        if self.peak_bytes < max(self.end_bytes, self.baseline_bytes):
            raise ValueError(
                f"peak_bytes {self.peak_bytes} is below end_bytes {self.end_bytes} or "
                f"baseline_bytes {self.baseline_bytes}; the measurement is inconsistent"
            )


def collect_tensors(objs: Iterable[Any]) -> list[torch.Tensor]:
    """Tensors held by `objs`: modules give parameters, their ``.grad`` and buffers;
    tensors give themselves (and their ``.grad``); containers are flattened."""
    found: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                found.append(p)
                if p.grad is not None:
                    found.append(p.grad)
            found.extend(obj.buffers())
            continue
        for leaf in tree_flatten(obj)[0]:
            if isinstance(leaf, torch.nn.Module):
                found.extend(collect_tensors([leaf]))
            elif isinstance(leaf, torch.Tensor):
                found.append(leaf)
                if leaf.grad is not None:
                    found.append(leaf.grad)
    return found


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for layouts without one (sparse, nested)."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return None
    return tensor.untyped_storage()


class LiveBytesTracker(TorchDispatchMode):
    """Count live tensor storage bytes on one device while the mode is active.

    Usage::

        with LiveBytesTracker(register=(model, *inputs)) as tracker:
            model(*inputs).loss.backward()
        tracker.peak_bytes, tracker.current_bytes, tracker.timeline

    Registered tensors (parameters, buffers, existing grads, inputs) count from the
    start. A storage first seen as an op *input* that was not registered existed before
    the mode (or was made outside the dispatcher); with ``discover_inputs=True`` it is
    counted as if registered: peak, current and every timeline point so far rise by its
    bytes, since it was live all along. ``discovered_bytes`` reports how much that was.
    """

    def __init__(
        self,
        *,
        register: Iterable[Any] = (),
        device: str | torch.device = "cpu",
        timeline: bool = False,
        discover_inputs: bool = True,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.record_timeline = timeline
        self.discover_inputs = discover_inputs
        self.current_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.discovered_bytes = 0
        self._timeline: list[list[Any]] = []  # [op, live_bytes]; shifted on discovery
        # storage key (StorageImpl address) -> (bytes, finalizer)
        self._live: dict[int, tuple[int, weakref.finalize]] = {}
        self._lock = threading.RLock()
        self._active = False
        for tensor in collect_tensors(register):
            self._track(tensor)
        self.baseline_bytes = self.current_bytes

    @property
    def timeline(self) -> tuple[TimelinePoint, ...]:
        return tuple(TimelinePoint(op=op, live_bytes=b) for op, b in self._timeline)

    @property
    def live_storages(self) -> int:
        """How many distinct storages are counted right now."""
        return len(self._live)

    def measurement(self) -> MemoryMeasurement:
        with self._lock:
            return MemoryMeasurement(
                peak_bytes=self.peak_bytes,
                end_bytes=self.current_bytes,
                baseline_bytes=self.baseline_bytes + self.discovered_bytes,
                instrument="dispatch",
                timeline=self.timeline,
            )

    def _counts(self, tensor: torch.Tensor) -> bool:
        if is_fake(tensor):  # a tracing stand-in (AOTAutograd's, remat's planning): no memory
            return False
        dev = tensor.device
        if dev.type != self.device.type:
            return False
        return self.device.index is None or dev.index == self.device.index

    def _track(self, tensor: torch.Tensor) -> int:
        """Count the tensor's storage if new (or resized); return the bytes added."""
        if not self._counts(tensor):
            return 0
        storage = _storage_of(tensor)
        if storage is None:
            return 0
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            known = self._live.get(key)
            if known is not None:
                if known[0] == nbytes:
                    return 0
                # Resized in place (an ``out=`` op, ``resize_``): count the difference.
                self._live[key] = (nbytes, known[1])
                return self._add(nbytes - known[0])
            # The finalizer runs when the storage's PyObject dies, which torch ties to the
            # StorageImpl itself (PyObject preservation), i.e. when the last tensor or view
            # referencing it is gone. The key is an address that may be reused afterwards,
            # so the finalizer only removes the entry it created.
            finalizer = weakref.finalize(storage, self._on_free, key)
            finalizer.atexit = False
            self._live[key] = (nbytes, finalizer)
            return self._add(nbytes)

    def _add(self, nbytes: int) -> int:
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        return nbytes

    def _on_free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current_bytes -= entry[0]

    def _discover(self, tensor: torch.Tensor) -> None:
        peak_before = self.peak_bytes
        added = self._track(tensor)
        if added:
            # It was live since before the step: every moment so far had it too.
            self.discovered_bytes += added
            self.peak_bytes = peak_before + added
            for point in self._timeline:
                point[1] += added
            log.debug("discovered %d unregistered bytes (%s)", added, tuple(tensor.shape))

    def __enter__(self) -> LiveBytesTracker:
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._active = False
        super().__exit__(*exc)

    def close(self) -> None:
        """Stop following storages still alive (drops the finalizers); counts freeze."""
        with self._lock:
            for _, finalizer in self._live.values():
                finalizer.detach()
            self._live.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # ``torch.tensor(...)`` / ``from_numpy`` build the tensor outside the dispatcher
        # and then call ``lift_fresh`` on it: that input is new, not pre-existing.
        if self.discover_inputs and func not in _FRESH_OPS:
            for leaf in tree_flatten((args, kwargs))[0]:
                if isinstance(leaf, torch.Tensor):
                    self._discover(leaf)
        out = func(*args, **kwargs)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        if self.record_timeline:
            self._timeline.append([str(func), self.current_bytes])
        return out


def _registered_bytes(register: Iterable[Any], device: torch.device) -> int:
    """Bytes of the distinct storages held by `register` on `device`."""
    seen: dict[int, int] = {}
    for tensor in collect_tensors(register):
        storage = _storage_of(tensor)
        if storage is None or tensor.device.type != device.type:
            continue
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _pick_instrument(instrument: str, register: tuple[Any, ...]) -> str:
    if instrument not in INSTRUMENTS:
        raise ValueError(f"unknown instrument {instrument!r}; use one of {INSTRUMENTS}")
    if instrument != "auto":
        return instrument
    on_cuda = any(t.is_cuda for t in collect_tensors(register))
    return "cuda" if on_cuda else "dispatch"


def measure_step(
    fn: Callable[[], Any],
    *,
    register: Iterable[Any] = (),
    instrument: str = "auto",
    timeline: bool = False,
    device: str | torch.device | None = None,
) -> MemoryMeasurement:
    """Run ``fn()`` once and measure its memory.

    `register`: modules and tensors that exist before the step and count from the start
    (the model, its inputs). ``instrument="auto"`` uses ``"cuda"`` when a registered
    tensor is on a GPU and the dispatch tracker otherwise.
    """
    register = tuple(register)
    chosen = _pick_instrument(instrument, register)
    if chosen == "cuda":
        return measure_step_cuda(fn, device=device)
    if chosen == "profiler":
        return measure_step_profiler(fn, register=register, device=device or "cpu")
    tracker = LiveBytesTracker(register=register, device=device or "cpu", timeline=timeline)
    try:
        with tracker:
            result = fn()
        measurement = tracker.measurement()
        del result
    finally:
        tracker.close()
    return measurement


def measure_step_cuda(fn: Callable[[], Any], *, device: str | torch.device | None = None) -> MemoryMeasurement:
    """Peak of ``fn()`` from the CUDA caching allocator's statistics (everything allocated
    on the device counts, including what existed before the step)."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_step_cuda needs CUDA; use instrument='dispatch' on CPU")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    baseline = torch.cuda.memory_allocated(dev)
    result = fn()
    torch.cuda.synchronize(dev)
    end = torch.cuda.memory_allocated(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del result
    return MemoryMeasurement(peak_bytes=peak, end_bytes=end, baseline_bytes=baseline, instrument="cuda")


def _allocation_events(prof: Any, device: torch.device) -> list[tuple[int, int, int]]:
    """(start_time_ns, order, alloc_size) of every allocator event on `device`."""
    events: list[tuple[int, int, int]] = []
    stack = list(reversed(compat.profiler_event_tree(prof)))
    while stack:
        event = stack.pop()
        extra = event.extra_fields
        size = getattr(extra, "alloc_size", None)
        if size is not None and extra.device.type == device.type:
            events.append((event.start_time_ns, len(events), int(size)))
        stack.extend(reversed(event.children))
    events.sort()
    return events


def measure_step_profiler(
    fn: Callable[[], Any],
    *,
    register: Iterable[Any] = (),
    device: str | torch.device = "cpu",
) -> MemoryMeasurement:
    """Peak of ``fn()`` from the profiler's allocator events (works under torch.compile).

    Peak = registered bytes + the largest running sum of allocation sizes (frees are
    negative). Frees of storage allocated before the step are invisible to the profiler,
    so a step that frees registered tensors reads high by their bytes.
    """
    dev = torch.device(device)
    baseline = _registered_bytes(register, dev)
    activities = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    del result
    running = high = 0
    end = None
    for _, _, size in _allocation_events(prof, dev):
        running += size
        high = max(high, running)
    end = running
    return MemoryMeasurement(
        peak_bytes=baseline + high,
        end_bytes=baseline + end,
        baseline_bytes=baseline,
        instrument="profiler",
    )
