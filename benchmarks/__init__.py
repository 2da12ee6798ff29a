"""Benchmarks of pipecat-taste; ``python benchmarks/run_all.py`` runs them all and writes BENCHMARKS.md."""
