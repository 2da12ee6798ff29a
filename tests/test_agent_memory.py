"""taste_agents.memory: the malloc settings of long-running agent processes."""

import platform

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


def test_release_free_memory_trims_on_glibc():
    assert release_free_memory() is GLIBC


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
