"""taste_agents.memory: the malloc settings of long-running agent processes."""

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from taste_agents.memory import configure_malloc, fix_mmap_threshold, limit_malloc_arenas, release_free_memory

GLIBC = platform.libc_ver()[0] == "glibc"


def test_rejects_a_cap_below_one():
    with pytest.raises(ValueError, match="arenas"):
        limit_malloc_arenas(0)


def test_rejects_an_mmap_threshold_below_a_page():
    with pytest.raises(ValueError, match="one page"):
        fix_mmap_threshold(100)


def test_the_users_environment_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert configure_malloc() == {"arenas": False, "mmap_threshold": False}


def test_applies_on_glibc(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    if not GLIBC:
        pytest.skip("glibc only")
    assert configure_malloc() == {"arenas": True, "mmap_threshold": True}


def _libc():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return libc


MMAPPED_BLOCKS = """
import ctypes
from taste_agents.memory import _MallInfo2, fix_mmap_threshold
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = _MallInfo2
assert fix_mmap_threshold(128 * 1024)
mmapped = []
for _ in range(3):
    before = libc.mallinfo2().hblks
    block = libc.malloc(256 * 1024)
    mmapped.append(libc.mallinfo2().hblks - before)
    libc.free(block)
print(mmapped)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33")
def test_blocks_over_the_threshold_stay_mmapped_after_one_is_freed():
    """glibc raises its mmap threshold to the size of each mmapped block freed, so the next block of
    that size comes from the heap (and stays there when freed); a fixed threshold keeps mmapping it.
    In a fresh process: a long-lived one's heap may have room for the block whatever the threshold."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    run = subprocess.run([sys.executable, "-c", MMAPPED_BLOCKS], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[1,", "1,", "1]"]


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not GLIBC or not os.path.exists("/proc/self/statm"), reason="glibc on Linux")
def test_release_free_memory_gives_freed_heap_memory_back():
    """64 MiB of small blocks freed inside the heap (a block after them keeps the heap's top from
    shrinking by itself) stay resident until the trim hands their pages back."""
    libc = _libc()
    blocks = [libc.malloc(4096) for _ in range(16384)]
    for block in blocks:
        libc.memset(block, 1, 4096)  # (touched: resident)
    pin = libc.malloc(4096)
    for block in blocks:
        libc.free(block)
    held = _resident_mib()
    assert release_free_memory()
    assert held - _resident_mib() > 48
    libc.free(pin)


def test_heap_stats_see_a_held_block():
    from taste_agents.memory import heap_stats

    before = heap_stats()
    if before is None:
        pytest.skip("needs glibc >= 2.33")
    held = bytearray(64 * 2**20)  # one block, mmapped: counted in use while held
    during = heap_stats()
    del held
    after = heap_stats()
    assert during["in_use"] - before["in_use"] >= 63
    assert during["in_use"] - after["in_use"] >= 63
