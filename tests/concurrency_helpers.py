"""Run test bodies in threads at once, as the plugin runs calls, without losing their errors."""

import threading


def run_in_threads(fn, calls) -> None:
    """``fn(*args)`` for every ``args`` in ``calls``, each in its own thread at once; re-raises
    the first error once they have all ended."""
    errors = []

    def body(args):
        try:
            fn(*args)
        except Exception as error:  # a failure in a thread must fail the test
            errors.append(error)

    threads = [threading.Thread(target=body, args=(args,)) for args in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
