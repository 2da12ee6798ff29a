"""Pauses of Python's garbage collector during live calls, and how to keep them short.

A full collection walks every object the process tracks and holds the interpreter lock meanwhile:
every call's threads - the decoding, the synthesis, the event loop that plays the audio out -
stand still until it ends. A process serving the embedded tiny checkpoint tracks some 490
thousand objects once warmed up (modules, tokenizer tables, the models' modules and parameters),
and one full collection of them took 244 ms on a 2-core CPU (``benchmarks/bench_gc_pauses.py``,
BENCHMARKS.md section 17). Full collections are rare - Python runs one when the objects that
outlived younger collections have grown by a quarter of those the last one walked; none ran in
the benchmark's scripted calls, seven (up to 202 ms each) in a whole ``taste-agent call
--simulate``, start-up included - but one in a call cuts its audio for that long. Freezing what
start-up made (``gc.freeze``) takes it out of the collector's reach for good: a full collection
then walks what came since (0.0 ms there), and start-up's objects are still freed by their
reference counts (only cycles among them would stay).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive (``gc.freeze``): call it when the server is
    ready (after ``TasteEngine.warm_up``), before calls come. Process-wide. Returns the objects
    frozen (``gc.get_freeze_count``)."""
    gc.collect()  # (garbage frozen would stay for good)
    gc.freeze()
    return gc.get_freeze_count()
