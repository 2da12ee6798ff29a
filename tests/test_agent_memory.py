"""taste_agents.memory: the malloc arena cap of long-running agent processes."""

import pytest

from taste_agents.memory import limit_malloc_arenas


def test_rejects_a_cap_below_one():
    with pytest.raises(ValueError, match="arenas"):
        limit_malloc_arenas(0)


def test_the_users_environment_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas(2) is False


def test_applies_on_glibc(monkeypatch):
    import platform

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert limit_malloc_arenas(2) is True


def test_release_free_memory_trims_on_glibc():
    import platform

    from taste_agents.memory import release_free_memory

    assert release_free_memory() is (platform.libc_ver()[0] == "glibc")
