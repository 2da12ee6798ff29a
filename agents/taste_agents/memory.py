"""Process-wide memory settings for long-running agents.

Every call runs its model stages in worker threads of its own, so a busy server creates and ends
threads all day. glibc gives threads their own malloc arenas (up to 8 per core) and memory freed
in one arena is not reused by another: the resident size creeps up with the number of calls that
ever ran. Capping the arenas trades a little allocation contention for memory that stays put
(measured with ``python -m benchmarks.soak``: see BENCHMARKS.md). Same effect as starting the
process with ``MALLOC_ARENA_MAX=N``. When a call ends, ``release_free_memory`` hands the heap
memory its objects freed back to the OS (glibc keeps freed blocks otherwise).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX = -8  # glibc <malloc.h>


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas for threads started from now on. Returns False where it cannot
    (not glibc, or MALLOC_ARENA_MAX already set by the user, which wins)."""
    if arenas < 1:
        raise ValueError("arenas must be >= 1")
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return the free memory at the top and inside glibc's heaps to the OS (``malloc_trim``).
    Called when a call has ended. Returns False where it cannot (not glibc)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
