"""Block tables of `dp` / `layers` kept on disk, so each architecture builds them once.

A table depends only on its block signature (`tables._signature`), the configuration
limit and the code that builds it, so a file named by the hash of (source hash,
signature, limit) holds the same table in any process. Building the large ones is the
cold cost of deep models (one pass over GPT-2's 57,600-configuration attention block:
~5 cpu s, LLaMA's 95,040: ~20 cpu s); reading one back takes well under a second.

Only tables of at least MIN_CONFIGS configurations are written (smaller ones are
rebuilt faster than a file is worth, and tests on small problems write nothing). The
cache is an optimization only: a missing, unreadable or corrupt file means the table is
built as before (logged at debug), and a failed write is ignored. Files are pickles in
the user's own cache directory (the same trust as any local cache). Turn it off with
REMAT_DP_TABLE_CACHE=0.

Torch-free and independent of `remat` (solvers/ imports neither), so the cache
directory rule of `remat.frontend.costs.cache_dir` is repeated here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "REMAT_CACHE_DIR"
"""Root of remat's caches (as in remat.frontend.costs); default ~/.cache/remat."""
ENABLE_ENV = "REMAT_DP_TABLE_CACHE"
"""Set to 0 to neither read nor write block tables on disk."""
SUBDIR = "dp-tables"
MIN_CONFIGS = 4096
"""Smallest table (configurations enumerated) worth a file: building 4,096
configurations of a GPT-2 block costs a few tenths of a second, reading a file
milliseconds."""

_SOURCES = ("dp/*.py", "problem.py", "simulate.py")
"""The code a table depends on (relative to solvers/): a change to any of it changes
every file name, so a stale table is never read."""

# What a truncated or foreign file can raise while unpickling.
_LOAD_ERRORS = (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError,
                KeyError, TypeError, ValueError)

Entry = tuple[dict, int, int]
"""(compiled table, configurations enumerated, steps charged per configuration), as
tables._TABLES holds it."""


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip() != "0"


def cache_dir() -> Path:
    """``$REMAT_CACHE_DIR/dp-tables`` or ``~/.cache/remat/dp-tables``."""
    override = os.environ.get(CACHE_ENV)
    root = Path(override) if override else Path.home() / ".cache" / "remat"
    return root / SUBDIR


@functools.cache
def source_hash() -> str:
    """sha256 over the names and bytes of the modules a table depends on (once per process)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for pattern in _SOURCES for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def path_for(sig: tuple, limit: int) -> Path:
    # repr is exact for what a signature holds (ints, floats, bools, None, enums, tuples)
    name = hashlib.sha256(repr((source_hash(), sig, limit)).encode()).hexdigest()
    return cache_dir() / f"{name}.pkl"


def load(sig: tuple, limit: int) -> Entry | None:
    """The stored entry for (sig, limit), or None (cache off, no file, unreadable file)."""
    if not enabled():
        return None
    path = path_for(sig, limit)
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except FileNotFoundError:
        return None
    except _LOAD_ERRORS as err:
        log.debug("dp table cache: ignoring unreadable %s: %s", path, err)
        return None
    if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], dict)
            and all(isinstance(x, int) for x in entry[1:])):
        log.debug("dp table cache: ignoring %s: not a (table, n_configs, steps) entry", path)
        return None
    log.debug("dp table cache: read %s (%d configurations)", path, entry[1])
    return entry


def store(sig: tuple, limit: int, entry: Entry) -> None:
    """Write the entry if the cache is on and the table is large enough; errors are ignored."""
    if not enabled() or entry[1] < MIN_CONFIGS:
        return
    path = path_for(sig, limit)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a unique temporary file then a rename: readers see a whole file or none, even
        # with several processes writing the same table
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=path.stem, suffix=".tmp",
                                         delete=False) as f:
            tmp = f.name
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        log.debug("dp table cache: wrote %s (%d configurations)", path, entry[1])
    except (OSError, pickle.PicklingError) as err:
        log.debug("dp table cache: could not write %s: %s", path, err)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
