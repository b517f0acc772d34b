"""Storage keys of the whole-step ledger (remat.runtime.step.storages): an int per storage,
the same number StorageWeakRef holds, reserved while a `Watched` holds it."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from remat.runtime.step.storages import Watched, key


def test_a_key_is_the_storage_not_the_tensor():
    t = torch.zeros(8)
    assert key(t) == key(t.view(2, 4)) == key(t[3:]) == StorageWeakRef(t.untyped_storage()).cdata
    assert key(t) != key(t.clone())


def test_watched_keeps_a_dead_storage_key_until_dropped():
    watched = Watched()
    live, dead = torch.zeros(4), torch.zeros(16)
    k_live = watched.watch(live.untyped_storage(), 16)
    k_dead = watched.watch(dead.untyped_storage(), 64)
    assert (k_live, k_dead) == (key(live), key(dead))
    del dead
    assert watched.alive(k_live) and not watched.alive(k_dead)
    assert watched.bytes == {k_live: 16, k_dead: 64}  # dead, not dropped yet
    watched.drop_dead()
    assert watched.bytes == {k_live: 16}


def test_a_watched_key_is_never_taken_by_a_new_storage():
    """Without a weak reference the allocator may hand a dead storage's address to the
    next storage (seen in a fresh process: the first one made after takes it; not
    asserted, it depends on the allocator's state); while watched, it cannot."""
    watched = Watched()
    t = torch.empty(16)
    k = watched.watch(t.untyped_storage(), 64)
    del t
    assert not any(key(torch.empty(16)) == k for _ in range(100))
