"""Process-wide malloc settings for long-running agents.

A busy server allocates and frees the same working set call after call, from many threads. Two
glibc defaults make its resident size creep up although nothing leaks (measured: live heap flat,
RSS up; see BENCHMARKS.md section 6):

* per-thread arenas (up to 8 per core): memory freed in one arena is not reused by another.
  ``configure_malloc`` caps them (``M_ARENA_MAX``, as ``MALLOC_ARENA_MAX=2`` would);
* the dynamic mmap threshold: after a large block is freed glibc serves blocks of that size from
  the heap instead of ``mmap``, where short-lived audio and tensor buffers of many sizes then leave
  holes. ``configure_malloc`` fixes the threshold (``M_MMAP_THRESHOLD``, 128 KiB, which also stops
  the adjustment), so large buffers go back to the OS when freed.

When a call ends, ``release_free_memory`` hands the free pages inside the heap back to the OS
(``malloc_trim``), on a thread. Measured while other calls talk (``python -m benchmarks.soak --parts
trim-cost``, BENCHMARKS.md section 6): a few ms per trim, and no more event-loop lag than without
trims. Settings the user put in the environment (``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_``) win. Elsewhere than glibc every function here does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
M_ARENA_MAX = -8

DEFAULT_ARENAS = 2
DEFAULT_MMAP_THRESHOLD = 128 * 1024


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None


def _mallopt(param: int, value: int, env_name: str) -> bool:
    if env_name in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt(param, value)) if mallopt is not None else False


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas for threads started from now on. Returns False where it cannot
    (not glibc, or MALLOC_ARENA_MAX already set by the user, which wins)."""
    if arenas < 1:
        raise ValueError("arenas must be >= 1")
    return _mallopt(M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX")


def fix_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``nbytes`` and more with ``mmap`` (returned to the OS on free) and stop glibc
    from raising the threshold. Returns False where it cannot (not glibc, or
    MALLOC_MMAP_THRESHOLD_ set by the user)."""
    if nbytes < 4096:
        raise ValueError("the mmap threshold must be at least one page (4096 bytes)")
    return _mallopt(M_MMAP_THRESHOLD, nbytes, "MALLOC_MMAP_THRESHOLD_")


def configure_malloc(arenas: int = DEFAULT_ARENAS, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> dict[str, bool]:
    """Both settings, once at start-up (before the calls' threads exist). Returns what was applied."""
    return {"arenas": limit_malloc_arenas(arenas), "mmap_threshold": fix_mmap_threshold(mmap_threshold)}


def release_free_memory() -> bool:
    """Return the free memory at the top and inside glibc's heaps to the OS (``malloc_trim``).
    Called when a call has ended. Returns False where it cannot (not glibc)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> dict[str, float] | None:
    """glibc's own account of the heap (``mallinfo2``), in MiB: ``in_use`` (blocks the program holds,
    mmapped ones included: what a leak raises), ``free_in_heap`` (freed blocks glibc keeps:
    fragmentation), ``heap`` (the heaps' size). None where it is not available (not glibc >= 2.33)."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    mb = 2.0 ** 20
    return {"in_use": round((info.uordblks + info.hblkhd) / mb, 1), "free_in_heap": round(info.fordblks / mb, 1),
            "heap": round(info.arena / mb, 1)}
