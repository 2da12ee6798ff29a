"""Decode steps of concurrent calls: each call stepping alone vs one batched step for all.

N calls (one thread each, as the plugin runs them) each prefill their own history and then
decode ``--steps`` positions, for two decoders:

* spoken LM: 64 rows of history, then one row per step (``LMStepBatch``);
* speech decoder: a 20-row prefix, then one speech token per step, chosen greedily from the
  step's log-probs as the plugin's sampler does (``SpeechStepBatch``);
* flow + vocoder: each step is one steady chunk of streaming synthesis (an 82-frame flow window,
  then a 58-frame HiFT window; ``SynthesisGraphs`` on its static path).

Two ways, same inputs, same process, back to back:

* alone: every call feeds its own cache (the growing cache on a CPU, the static one on CUDA:
  the path each device uses when calls step alone); synthesis: every call has its own
  ``SynthesisGraphs`` (one window per step);
* batched: every call holds a slot of one batch; whatever steps are waiting run as one forward
  (``taste_speech.batched_steps``; on CUDA one captured graph per batch size); synthesis: one
  ``SynthesisGraphs(rows=16)`` for all, whose waiting windows run as one step.

Printed per decoder and N: wall time per step as one call sees it, all calls' steps per
second, the ratio batched / alone, and the mean number of calls a batched step served.

    python benchmarks/bench_batched_steps.py                                  # tiny, CPU, 1/2/4/8 calls
    python benchmarks/bench_batched_steps.py --models tiny,full --steps 20    # + published dimensions
    python benchmarks/bench_batched_steps.py --models full --device cuda --dtype bfloat16 --calls 1,2,4,8,16

With ``--write`` the table goes to ``benchmarks/results/batched_steps.md`` (+ .json) and into
BENCHMARKS.md as its section 4b, which ``run_all.py`` keeps when it regenerates the rest.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.bench_lm_cache import sync, tiny_model  # noqa: E402
from benchmarks.engines import FULL_CONFIG  # noqa: E402
from benchmarks.bench_lm_cache import full_model as full_spoken_lm  # noqa: E402
from taste_speech.lm_batch import LMStepBatch  # noqa: E402
from taste_speech.speech_decoder_batch import SpeechStepBatch  # noqa: E402

CONTEXT = 64  # rows of history each call's spoken LM prefills (different rows per call)
PREFIX = 20  # rows of each call's speech-decoder prefix
RESULTS = ROOT / "benchmarks" / "results"
SECTION_NUMBER = "## 4b. "
SECTION = SECTION_NUMBER + "Decode and synthesis steps of concurrent calls: each alone vs batched"
DECODERS = ("spoken LM", "speech decoder", "flow + vocoder")


class SpokenLMCalls:
    """The spoken LM's side: a state per call, one row per step."""

    def __init__(self, model: str, device, dtype, steps: int):
        self.lm = (tiny_model(device, dtype)[0] if model == "tiny" else full_spoken_lm(device, dtype)[0]).eval()
        self.batch = LMStepBatch(self.lm, slots=16, capacity=CONTEXT + steps + 64)
        self.alone_kind, self.steps, self.device = "static" if device.type == "cuda" else "dynamic", steps, device

    def inputs(self, calls: int) -> list[torch.Tensor]:
        hidden = self.lm.causal_lm.config.hidden_size
        return [(torch.randn(1, CONTEXT + self.steps, hidden, generator=torch.Generator().manual_seed(i)) * 0.5)
                .to(device=self.device, dtype=self.lm.lm_dtype) for i in range(calls)]

    def start(self, rows: torch.Tensor, batched: bool):
        cache = self.batch.open() if batched else self.lm.new_cache(self.alone_kind, capacity=CONTEXT + self.steps + 8)
        state = self.lm.new_decode_state(cache=cache)
        self.lm.feed(state, rows[:, :CONTEXT - 1])
        self.lm.feed(state, rows[:, CONTEXT - 1:CONTEXT])  # a first one-row step, untimed: a static cache captures here
        return state

    def step(self, state, rows: torch.Tensor, i: int) -> None:
        self.lm.feed(state, rows[:, CONTEXT + i:CONTEXT + i + 1])

    def end(self, state) -> None:
        getattr(state.cache, "close", lambda: None)()


class SpeechDecoderCalls:
    """The speech decoder's side: a decode per call, one greedy speech token per step."""

    def __init__(self, model: str, device, dtype, steps: int):
        if model == "tiny":  # the embedded tiny checkpoint's
            from taste_speech.modeling_taste import TasteForCausalLM
            from taste_speech.tiny import default_tiny_checkpoint

            self.decoder = TasteForCausalLM.from_pretrained(default_tiny_checkpoint()).speech_decoder
        else:
            from taste_speech.configuration_taste import TasteConfig
            from taste_speech.modeling_speech_decoder import TasteSpeechDecoder

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.decoder = TasteSpeechDecoder(TasteConfig.from_json_file(str(FULL_CONFIG)))
        self.decoder = self.decoder.to(device=device, dtype=dtype).eval()
        self.batch = SpeechStepBatch(self.decoder, slots=16, capacity=PREFIX + steps + 8)
        self.alone_kind, self.steps, self.device = "static" if device.type == "cuda" else "dynamic", steps, device

    def inputs(self, calls: int) -> list[torch.Tensor]:
        width = self.decoder.llm.input_size
        return [torch.randn(1, PREFIX, width, generator=torch.Generator().manual_seed(i))
                .to(device=self.device, dtype=self.decoder.dtype) for i in range(calls)]

    def start(self, prefix: torch.Tensor, batched: bool):
        cache = self.batch.open() if batched else self.decoder.new_cache(self.alone_kind, capacity=PREFIX + self.steps + 8)
        n = self.steps + 2  # min_len = max_len: never an early EOS
        state = self.decoder.start(prefix, min_len=n, max_len=n, cache=cache)
        self.decoder.step(state)  # a first step, untimed: a static cache captures its graph here
        return state

    def step(self, state, prefix: torch.Tensor, i: int) -> None:
        self.decoder.step(state)

    def end(self, state) -> None:
        getattr(state.cache, "close", lambda: None)()


class SynthesisCalls:
    """Streaming synthesis's side: one steady chunk's flow and vocoder windows per step (the
    voice generator stays float32, as the engine runs it)."""

    FLOW_FRAMES, VOCODER_FRAMES = 82, 58  # a low_latency steady chunk (synthesis_graphs' docstring)

    def __init__(self, model: str, device, dtype, steps: int):
        from benchmarks.engines import full_voice_generator
        from taste_speech.streaming.synthesis_graphs import SynthesisGraphs
        from taste_speech.tiny import default_tiny_checkpoint
        from taste_speech.voice_generator import VoiceGenerator

        self.vg = (VoiceGenerator.from_pretrained(default_tiny_checkpoint(), device=device) if model == "tiny"
                   else full_voice_generator(str(device))).eval()
        self.new_graphs = lambda rows: SynthesisGraphs(self.vg, rows=rows)
        self.shared = self.new_graphs(16)
        self.own: list = []  # each call's own graphs when alone (kept: captured once per call index)
        self.batch, self.device = self, device  # warm_up() and stats() as the decode batches have them
        self.steps = steps

    def warm_up(self) -> None:
        self.shared.warm_up([self.FLOW_FRAMES], [self.VOCODER_FRAMES])

    def stats(self) -> dict:
        stats = self.shared.stats()
        return {"steps": sum(stats[s]["steps"] for s in ("flow", "vocoder")),
                "rows_stepped": sum(stats[s]["windows"] for s in ("flow", "vocoder"))}

    def inputs(self, calls: int) -> list[tuple]:
        c, spf = self.vg.flow.output_size, self.vg.hift.samples_per_frame
        windows = []
        for i in range(calls):
            g = torch.Generator().manual_seed(i)
            # (the flow step's inputs: the window's token features stretched to its frames, cond, noise)
            stretched, cond, noise = (torch.randn(1, c, self.FLOW_FRAMES, generator=g) for _ in range(3))
            mel = torch.randn(1, self.vg.hift.conv_pre.in_channels, self.VOCODER_FRAMES, generator=g) - 5
            source = 0.1 * torch.randn(1, 1, self.VOCODER_FRAMES * spf, generator=g)
            windows.append((i, tuple(x.to(self.device) for x in (stretched, torch.randn(1, c, generator=g), cond, noise)),
                            (mel.to(self.device), source.to(self.device))))
        return windows

    def start(self, window: tuple, batched: bool):
        if batched:
            return self.shared
        while len(self.own) <= window[0]:
            self.own.append(self.new_graphs(1))
            self.own[-1].warm_up([self.FLOW_FRAMES], [self.VOCODER_FRAMES])
        return self.own[window[0]]

    def step(self, graphs, window: tuple, i: int) -> None:
        graphs.flow(*window[1], owner=window)  # the window stands for its call's utterance
        graphs.vocoder(*window[2], owner=window, more=i < self.steps - 1)  # the next chunk's tokens are there

    def end(self, graphs) -> None:
        pass


SIDES = {"spoken LM": SpokenLMCalls, "speech decoder": SpeechDecoderCalls, "flow + vocoder": SynthesisCalls}


def run_calls(side, inputs: list[torch.Tensor], steps: int, batched: bool) -> float:
    """Seconds from the common start to the last call's last step (prefills before the start)."""
    states = [side.start(x, batched) for x in inputs]
    start, errors = threading.Barrier(len(inputs) + 1), []

    def decode(state, x):
        try:
            with torch.no_grad():
                start.wait()
                for i in range(steps):
                    side.step(state, x, i)
        except Exception as error:  # re-raised below: a failing call must not look fast
            errors.append(error)

    threads = [threading.Thread(target=decode, args=(s, x)) for s, x in zip(states, inputs)]
    for thread in threads:
        thread.start()
    sync(side.device)
    start.wait(timeout=600)
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    sync(side.device)
    elapsed = time.perf_counter() - t0
    for state in states:
        side.end(state)
    if errors:
        raise errors[0]
    return elapsed


@torch.no_grad()
def measure(models: list[str], calls: list[int], *, steps: int = 40, device: str = "cpu", dtype: str = "float32",
            decoders=DECODERS, log=print) -> list[dict]:
    dev, torch_dtype = torch.device(device), getattr(torch, dtype)
    results = []
    for name in models:
        for decoder in decoders:
            side = SIDES[decoder](name, dev, torch_dtype, steps)
            side.batch.warm_up()
            for n in calls:
                inputs = side.inputs(n)
                run_calls(side, inputs, 2, batched=False)  # warm-up: allocations, kernel choice
                run_calls(side, inputs, 2, batched=True)
                alone = run_calls(side, inputs, steps, batched=False)
                before = side.batch.stats()
                batched = run_calls(side, inputs, steps, batched=True)
                after = side.batch.stats()
                served = (after["rows_stepped"] - before["rows_stepped"]) / max(1, after["steps"] - before["steps"])
                row = {"model": name, "decoder": decoder, "calls": n, "steps": steps,
                       "alone_ms_per_step": 1000 * alone / steps, "batched_ms_per_step": 1000 * batched / steps,
                       "alone_steps_per_s": n * steps / alone, "batched_steps_per_s": n * steps / batched,
                       "mean_batch": served}
                row["throughput_ratio"] = row["batched_steps_per_s"] / row["alone_steps_per_s"]
                results.append(row)
                log(f"{name} {decoder} {n} calls: alone {row['alone_ms_per_step']:.2f} ms/step "
                    f"({row['alone_steps_per_s']:.0f} steps/s), batched {row['batched_ms_per_step']:.2f} ms/step "
                    f"({row['batched_steps_per_s']:.0f} steps/s), x{row['throughput_ratio']:.2f}, mean batch {served:.2f}")
            del side
    return results


def rate(steps_per_s: float) -> str:
    return f"{steps_per_s:.0f}" if steps_per_s >= 10 else f"{steps_per_s:.2f}"


def markdown(results: list[dict]) -> list[str]:
    lines = ["| model | decoder | calls | alone ms/step | batched ms/step | alone steps/s | batched steps/s | "
             "batched / alone | mean batch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['decoder']} | {r['calls']} | {r['alone_ms_per_step']:.2f} | "
                     f"{r['batched_ms_per_step']:.2f} | "
                     f"{rate(r['alone_steps_per_s'])} | {rate(r['batched_steps_per_s'])} | {r['throughput_ratio']:.2f}x | "
                     f"{r['mean_batch']:.2f} |")
    return lines


def benchmarks_section(results_dir: Path = RESULTS) -> list[str]:
    """The last ``--write`` run as a section of BENCHMARKS.md ([] before the first)."""
    return report.saved_section(SECTION, Path(results_dir) / "batched_steps.md")


def update_benchmarks_md(path: Path = ROOT / "BENCHMARKS.md", results_dir: Path = RESULTS) -> None:
    """Put the section before section 5 (GPU), in place of any earlier section 4b."""
    report.replace_section(path, SECTION_NUMBER, benchmarks_section(results_dir), before="## 5. ")


def write_results(results: list[dict], command: str, facts: dict, results_dir: Path = RESULTS) -> None:
    intro = ["# Decode and synthesis steps of concurrent calls", "",
             "N calls (one thread each, as the plugin runs them) prefill their own history (spoken LM: 64 rows; "
             "speech decoder: a 20-row prefix), then decode one position per step (speech decoder: a greedy speech "
             "token). *Alone*: each call feeds its own cache (the growing cache on a CPU, the static one on CUDA). "
             "*Batched*: each call holds a slot of one `LMStepBatch` / `SpeechStepBatch` "
             "(`taste_speech/batched_steps.py`) and the steps waiting at the same moment run as one forward. "
             "Flow + vocoder: a step is one steady synthesis chunk (an 82-frame flow window, then a 58-frame HiFT "
             "window, padded to their buckets); alone, each call has its own `SynthesisGraphs`; batched, one "
             "`SynthesisGraphs(rows=16)` runs the windows waiting at the same moment as one step (`taste_speech/"
             "streaming/synthesis_graphs.py`; mean batch counts both stages' windows per step). ms/step = wall time per step as one call sees "
             "it; steps/s = all calls together; mean batch = call steps per batched forward. Both ways run back to "
             "back in one process; the ratio is the figure to read. On a CPU batching pays only past the core "
             "count: calls stepping alone already run in parallel on the cores, and each call's heads (the text "
             "head over 128 256 ids at full size, the speech decoder's sampling) run in its own thread between steps, so the engine batches by "
             "default only on the CUDA fast path, where a step costs its kernel launches, not its rows "
             "(our H100 notes: 2.9 ms for one call, 4.4 ms for eight batched). No GPU figures yet.", ""]
    report.save_results(Path(results_dir), "batched_steps", intro, markdown(results), results, command, facts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny", help="comma-separated: tiny, full")
    parser.add_argument("--decoders", default="lm,speech,synthesis", help="comma-separated: lm, speech, synthesis")
    parser.add_argument("--calls", default="1,2,4,8", help="comma-separated numbers of concurrent calls")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--write", action="store_true",
                        help="save to benchmarks/results/batched_steps.md and update BENCHMARKS.md section 4b")
    args = parser.parse_args(argv)
    calls = [int(n) for n in args.calls.split(",")]
    decoders = [{"lm": "spoken LM", "speech": "speech decoder", "synthesis": "flow + vocoder"}[d]
                for d in args.decoders.split(",")]
    results = measure(args.models.split(","), calls, steps=args.steps, device=args.device, dtype=args.dtype,
                      decoders=decoders)
    print("\n".join(markdown(results)))
    if args.write:
        command = "python benchmarks/bench_batched_steps.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        write_results(results, command.strip(), report.machine_facts(args.device, args.dtype))
        update_benchmarks_md()
    return 0


if __name__ == "__main__":
    sys.exit(main())
