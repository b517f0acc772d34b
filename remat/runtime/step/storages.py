"""Storage identity for the ledger: a plain int per storage, a weak reference only where needed.

A storage's key is the address of its `StorageImpl` (`untyped_storage()._cdata`, the number
a `StorageWeakRef` holds and hashes by). Two live tensors share a key exactly when they
share a storage. A dead storage's address could be taken by a new one, but not while a
weak reference to it is held: a weak reference keeps the `StorageImpl`'s memory allocated
after the storage dies (c10's intrusive_ptr frees it when the weak count drops to zero).
So the ledger holds a weak reference for every key it keeps beyond a call (`Watched`) and
uses bare ints for live tensors within a call.

`Watched` takes those weak references the way `StorageWeakRef` does (`_weak_ref`,
`_expired`, `_free_weak_ref`: the number it returns is the key) without a Python object
per storage: per storage seen and dropped that is about 0.11 µs instead of 0.36 µs, and a
death check 0.04 µs instead of 0.16 µs (torch 2.13, 1 CPU thread); LLaMA tiny's one graph
saves some 45 new storages every step.
"""

from __future__ import annotations

import weakref

import torch

from remat.compat import storage_expired, storage_free_weak_ref

expired = storage_expired
"""expired(key) -> bool: whether a held key's storage died (a C call, no Python frame)."""
_free_weak_ref = storage_free_weak_ref


def key(t: torch.Tensor) -> int:
    """The key of `t`'s storage (valid while `t` lives, or while a `Watched` holds it)."""
    return t.untyped_storage()._cdata


class Watched:
    """Storages held by a weak reference each, keyed by `key`, with their bytes: a key
    stays that storage's until `drop_dead` drops it (the storage died) or this dies."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        """Key -> the storage's bytes when last seen."""
        weakref.finalize(self, _free_all, self.bytes)

    def watch(self, storage: torch.UntypedStorage, nbytes: int) -> int:
        """Hold `storage` (not held yet) with `nbytes`; returns its key."""
        handle = storage._weak_ref()  # == storage._cdata: one weak reference more
        self.bytes[handle] = nbytes  # (the ledger inlines this in its loops)
        return handle

    def alive(self, handle: int) -> bool:
        return not expired(handle)

    def drop_dead(self) -> None:
        """Drop (and release) the storages that died."""
        held = self.bytes
        for handle in [k for k in held if expired(k)]:
            del held[handle]
            _free_weak_ref(handle)


def _free_all(held: dict[int, int]) -> None:
    for handle in held:
        _free_weak_ref(handle)
    held.clear()
