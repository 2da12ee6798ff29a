#!/usr/bin/env bash
# The whole test suite, the way CI runs it on a 2-core machine. Most tests spend their time waiting
# on real-time audio, so they run on two workers (pytest-xdist, a test file per worker at a time).
# The tests marked `serial` run alone afterwards: they run several real-time calls at once (caller
# processes, chromium) or measure barge-in stops and underruns against real-time playout, and a
# second worker beside them would push them past real time or into its figures.
# `.venv/bin/python -m pytest -q` runs the same tests one after another. The slowest tests are listed
# at the end of each part (CI time is bounded: keep an eye on them).
cd "$(dirname "$0")/.."
status=0
.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=25 || status=$?
.venv/bin/python -m pytest -q -m serial --durations=10 || status=$?
exit "$status"
