"""The host's waits for the GPU, counted with torch's sync debug mode (the CUDA tests)."""

import contextlib
import os
import warnings

import torch

# torch's warning at each wait: "called a synchronizing CUDA operation". Its notice that the debug
# mode is a prototype (once per process, when the mode is first set) speaks of "synchronizing
# operations" too, and is no wait: the whole phrase is matched.
WAIT_MESSAGE = "called a synchronizing"


def wait_sites(caught) -> list[str]:
    """For each wait among recorded warnings, 'file:line' of the Python line that waited (a failing
    count then says where the extra wait is)."""
    return [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught if WAIT_MESSAGE in str(w.message)]


@contextlib.contextmanager
def recorded_waits():
    """The warnings of the block, recorded into the list it yields, with the sync debug mode on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
