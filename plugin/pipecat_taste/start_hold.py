"""StartNeeds: how long the start of recent replies had to be held, remembered per engine.

The playout measures, for each reply, how much later than its first chunk the next chunks at
its start arrived, beyond the audio ahead of them: the hold that reply needed to play without a
gap (``TastePlayout``, "start hold"). The hardware and the load decide that need, not the call,
so the needs are kept by the engine that all calls share: the first reply of a new call is then
held as long as the engine's recent replies needed, instead of gapping while its own call learns.
"""

from __future__ import annotations

import collections
import threading


class StartNeeds:
    def __init__(self, memory: int = 3):
        """``memory``: replies to learn from (the hold follows the largest need among the last ones)."""
        if memory < 1:
            raise ValueError(f"StartNeeds: memory must be >= 1 (replies to learn the start hold from), got {memory}")
        self._needs: collections.deque[float] = collections.deque(maxlen=memory)
        self._lock = threading.Lock()  # an engine may serve calls on more than one event loop

    def record(self, need_s: float) -> None:
        """One played reply's need in seconds (negative: its chunks came with time to spare)."""
        with self._lock:
            self._needs.append(float(need_s))

    def largest(self) -> float:
        """The largest need among the recent replies; 0 before any."""
        with self._lock:
            return max(self._needs, default=0.0)
