"""Operators left outside captured steps, per first-audio stage - counted on a CPU.

    python benchmarks/bench_eager_ops.py [--size tiny|full] [--device cpu|cuda] [--dtype bfloat16]

On a GPU every operator that runs outside a captured step is at least one kernel launch, each a few
microseconds of the host's time and a turn at the driver's lock; with eight calls ending at once the
H100 profile counted 8434 of them in the span (BENCHMARKS.md section 5), with the GPU idle half the
time. Which stage leaves how many is a question of the code, not the card, so it is counted here:
one user turn to first audio (the GPU suite's turn and forced 12-word reply, ``gpu_suite.first_audio``),
every operator counted as the dispatcher sees it (``TorchDispatchMode``), those inside a step's run
counted once as the step. Two paths in one run: the eager path (``decoding='eager'``, the baseline)
and the fast path with every step rehearsed (``step_graph``'s 'rehearse' mode: the capture protocol,
then the step runs as its replay would, its outputs overwritten in place) - what runs outside the
steps is then exactly what runs outside the graphs on CUDA. The CUDA-only shared steps (the tower's
encoder and text side, the calls' synthesis steps) are made here too, rehearsed. Host-only operators
(the log-mel, the word alignment: CPU tensors on a GPU host too) are counted as well, so the counts
are an upper bound of the launches. With ``--device cuda`` the fast path runs as it does there (real
graphs, nothing patched), and the counts are those of the real dimensions' code on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import gpu_suite  # noqa: E402

STAGES = gpu_suite.STAGES
# the modules that resolve a step's graph mode where they make their steps
GRAPH_MODE_MODULES = ("taste_speech.step_graph", "taste_speech.lm_cache", "taste_speech.speech_decoder_cache",
                      "taste_speech.speech_decoder_batch", "taste_speech.pooler_graph",
                      "taste_speech.streaming.synthesis_graphs", "pipecat_taste.whisper_decode")


@contextlib.contextmanager
def rehearsed_fast_path():
    """The CUDA fast path on a CPU: 'auto' graph modes resolve to 'rehearse' (not 'eager'), the static
    synthesis path is taken, and the engine makes its CUDA-only shared steps (tower encoder and text
    side, synthesis steps - one row, a call alone) rehearsed. Undone at the end of the block."""
    from pipecat_taste import engine as engine_module
    from taste_speech.encoder_graph import EncoderGraph
    from taste_speech.pooler_graph import PoolerGraph
    from taste_speech.streaming import synthesis as synthesis_module
    from taste_speech.streaming import synthesis_graphs
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs

    def rehearse(mode, device):
        return "rehearse" if mode in ("auto", "graph") else mode

    def static(kind, device):
        return "static" if kind == "auto" else kind

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patches())
        for name in GRAPH_MODE_MODULES:
            module = importlib.import_module(name)
            if hasattr(module, "resolve_mode"):
                patch(module, "resolve_mode", rehearse)
        patch(synthesis_graphs, "resolve_kind", static)
        patch(synthesis_module, "resolve_kind", static)
        patch(engine_module, "_tower_encoder",
              lambda model, decoding, slots: None if decoding == "eager" else
              EncoderGraph(model.audio_tower, graph_mode="rehearse", rows=8))
        patch(engine_module, "_tower_pooler",
              lambda model, decoding: None if decoding == "eager" else PoolerGraph(model.audio_tower, "rehearse"))
        patch(engine_module, "_synthesis_graphs",
              lambda vg, slots, kind, compile_flow=False: None if kind == "dynamic" else
              SynthesisGraphs(vg, graph_mode="rehearse", rows=1))
        yield


@contextlib.contextmanager
def _patches():
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


class StageCounts(TorchDispatchMode):
    """Operators per stage of ``gpu_suite.Clock`` (the stage a mark closes), those inside a
    ``StepGraph.run`` counted once as a step run."""

    def __init__(self):
        super().__init__()
        self.stage = None  # not counting: the call's start and the partial transcripts, before the turn ends
        self.eager = collections.Counter()
        self.steps = collections.Counter()
        self._inside = threading.local()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stage is not None and not getattr(self._inside, "depth", 0):
            self.eager[self.stage] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        from taste_speech import step_graph

        counts = self
        run, mark = step_graph.StepGraph.run, gpu_suite.Clock.mark

        def counted_run(step):
            if counts.stage is not None:
                counts.steps[counts.stage] += 1
            counts._inside.depth = getattr(counts._inside, "depth", 0) + 1
            try:
                return run(step)
            finally:
                counts._inside.depth -= 1

        def next_stage(clock, stage):
            mark(clock, stage)
            following = STAGES.index(stage) + 1 if stage in STAGES else len(STAGES)
            counts.stage = STAGES[following] if following < len(STAGES) else "after first audio"

        def turn_ended(clock, *args):  # the timed part starts with its Clock
            start(clock, *args)
            counts.stage = STAGES[0]
            counts.eager.clear(), counts.steps.clear()

        start = gpu_suite.Clock.__init__
        with _patches() as patch:
            patch(step_graph.StepGraph, "run", counted_run)
            patch(gpu_suite.Clock, "mark", next_stage)
            patch(gpu_suite.Clock, "__init__", turn_ended)
            with self:
                yield self


def count_turn(engine, asr, path, audio) -> StageCounts:
    """One warmed-up turn to first audio on ``path``'s engine, counted."""
    with gpu_suite.ForcedReply(engine.model.spoken_lm) as forced:
        gpu_suite.first_audio(engine, asr, path, forced, audio)  # a first turn: captures, lazy buffers
        counts = StageCounts()
        with counts.counting():
            gpu_suite.first_audio(engine, asr, path, forced, audio)
    return counts


def host_ms(engine, asr, path, audio, repeats: int = 5) -> list[float]:
    """First audio with every prepared step's run skipped (its last outputs handed back as they
    are): what is left is the host's work between the steps - the Python, the operators outside
    them, and on a CPU their small computations - the part of a call that concurrent calls' threads
    cannot share out to the GPU. Per stage, the median over ``repeats`` turns, in ms. The values the
    skipped steps would have made are stale, so it is a measure of time, not of output."""
    from taste_speech import step_graph

    run = step_graph.StepGraph.run

    def skipped(step):
        return step.outputs if step._prepared and step.outputs is not None else run(step)

    runs = []
    with gpu_suite.ForcedReply(engine.model.spoken_lm) as forced, _patches() as patch:
        gpu_suite.first_audio(engine, asr, path, forced, audio)  # (captures, lazy buffers)
        patch(step_graph.StepGraph, "run", skipped)
        for _ in range(repeats):
            runs.append(gpu_suite.first_audio(engine, asr, path, forced, audio))
    per_stage = {stage: sorted(r["stages"].get(stage, 0.0) for r in runs)[repeats // 2] for stage in STAGES}
    return {**per_stage, "first audio": sorted(r["first_audio_ms"] for r in runs)[repeats // 2]}


def measure(size: str = "tiny", device: str = "cpu", dtype: str | None = None, host: bool = False) -> dict:
    """{path: {stage: (operators outside steps, step runs)}} for the eager path and the fast path
    (rehearsed on a CPU, captured on CUDA; the key says 'fast path, rehearsed' either way); with
    ``host``, also the fast path's host ms per stage with its steps skipped (``host_ms``, under
    'host ms')."""
    torch.manual_seed(0)
    base = gpu_suite.build_engine(size, device, dtype)
    asr = gpu_suite.build_asr(size, base, device, dtype)
    audio = gpu_suite.user_audio()
    cpu = torch.device(device).type == "cpu"
    result = {}
    for name, path in (("eager", gpu_suite.EAGER), ("fast path, rehearsed", gpu_suite.GRAPHED)):
        with rehearsed_fast_path() if path is gpu_suite.GRAPHED and cpu else contextlib.nullcontext():
            engine = gpu_suite.path_engine(base, path)
            if engine.share_tower_encoder(asr[path.name]):  # (the fast path's: one encoder pass a turn)
                asr[path.name].warm_up()
            counts = count_turn(engine, asr, path, audio)
            if host and path is gpu_suite.GRAPHED:
                result["host ms"] = host_ms(engine, asr, path, audio)
        result[name] = {stage: (counts.eager[stage], counts.steps[stage]) for stage in STAGES}
    return result


def table(result: dict) -> list[str]:
    eager, fast, host = result["eager"], result["fast path, rehearsed"], result.get("host ms")
    lines = ["| stage | eager path: operators | fast path: operators outside steps | its step runs | fast / eager |"
             + (" fast path: host ms, steps skipped |" if host else ""),
             "| --- | --- | --- | --- | --- |" + (" --- |" if host else "")]
    for stage in STAGES:
        ratio = fast[stage][0] / eager[stage][0] if eager[stage][0] else float("nan")
        lines.append(f"| {stage} | {eager[stage][0]} | {fast[stage][0]} | {fast[stage][1]} | {ratio:.2f} |"
                     + (f" {host[stage]:.1f} |" if host else ""))
    total_e, total_f = sum(v[0] for v in eager.values()), sum(v[0] for v in fast.values())
    lines.append(f"| first audio | {total_e} | {total_f} | {sum(v[1] for v in fast.values())} | "
                 f"{total_f / total_e:.2f} |" + (f" {host['first audio']:.1f} |" if host else ""))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"],
                        help="full: the published dimensions, random weights (23 GB and half an hour on a 2-core CPU)")
    parser.add_argument("--device", default="cpu", help="cpu (the fast path's steps rehearsed) or cuda (captured)")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: the device's run dtypes)")
    parser.add_argument("--host-ms", action="store_true",
                        help="also time the fast path's first audio with its steps' runs skipped: the host's work "
                             "between the steps, per stage (median of 5 turns)")
    args = parser.parse_args(argv)
    print(f"# operators outside captured steps per first-audio stage ({args.size} size, {args.device}, "
          f"{args.dtype or 'default dtypes'}, torch {torch.__version__})")
    print("\n".join(table(measure(args.size, args.device, args.dtype, host=args.host_ms))))


if __name__ == "__main__":
    main()
