"""The audio tower's text side per turn: eager vs ``PoolerGraph`` (one captured step per length bucket).

After the shared Whisper encoder pass, each call's turn still goes through the tower's text side:
the 2-layer decoder as attention pooler, the word means, the RVQ search and the mapping to Llama
tokens. On a GPU at batch 1 it costs its kernel launches and its host reads (each waits for every
kernel queued before it - with many calls, the other calls' kernels too), not its arithmetic.

What transfers from a CPU, counted here per turn (the encoder's states given, the same in both):
- operators dispatched: eager, every one is a kernel launch on CUDA; with the pooler, those inside
  its step are one graph replay, and those outside it are the copies in and out and the host's own
  work on the ids (the word runs, the mapping to Llama tokens), which launches nothing;
- host reads of tensor values (``.item()``, ``int()``, ``bool()`` of a tensor): on CUDA each one
  waits for the GPU's queue (the pooler's one read of the codes is a copy, not counted here).
CPU milliseconds are printed too; on a CPU the pooler's padding to its bucket is extra arithmetic,
so the CPU keeps the eager path (``TasteEngine`` makes a pooler on CUDA only). GPU times: the
``levers`` part of ``benchmarks.gpu_suite`` (row "audio tower ms").

    python benchmarks/bench_tower_text.py            # tiny checkpoint (the same layers as the full size)
    python benchmarks/bench_tower_text.py --size full
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_lora_merge import OperatorCount, load_model  # noqa: E402
from taste_speech.pooler_graph import PoolerGraph  # noqa: E402

TURNS = {  # (seconds, transcript): section 5's user turn, and a longer one
    "3 s, 10 words": (3.0, "hello there could you tell me what time it is"),
    "8 s, 24 words": (8.0, "I would like to book a table for two people tonight at eight and if that is not "
                           "possible then tomorrow at seven would also be fine thanks"),
}


def turn(processor, seconds: float, text: str):
    t = np.arange(int(16000 * seconds)) / 16000
    wav = (0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    aligned = processor.align_llm_ids(processor.process_text(text).llm_token_ids)
    return processor.audio_features(wav, 16000), aligned


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


@torch.inference_mode()
def figures(model, processor, seconds: float, text: str, repeats: int) -> dict:
    tower = model.audio_tower
    features, aligned = turn(processor, seconds, text)
    states = tower.encode_audio(features)
    given = lambda window: states  # noqa: E731 - the encoder's states, the same for both ways
    ids = (aligned.asr_token_ids, aligned.asr_word_ids, aligned.llm_word_ids)
    pooler = PoolerGraph(tower, "rehearse")  # the capture protocol, then eager steps: what a CPU can run

    def eager():  # taste_tokenize's way without a pooler: ids on the model's device
        return tower.extract_vq(features, *ids, encoder=given)[1]

    def fast():  # with one: host ids, the codes read once
        return tower.extract_vq(features, *ids, encoder=given, pooler=pooler)[1]

    assert torch.equal(eager(), fast()), "the pooler's codes differ from the eager ones"
    out = {"whisper_tokens": int(aligned.asr_token_ids.shape[1])}
    size = next(b for b in pooler.buckets if b >= out["whisper_tokens"] + 5)
    for name, run in (("eager", eager), ("pooler", fast)):
        with OperatorCount() as counter:
            run()
        out[name] = {"ops": counter.total, "host_reads": counter.reads,
                     "cpu_ms": median_ms(run, repeats)}
    with OperatorCount() as inside:  # the step alone: what one graph replay launches on CUDA
        pooler._step(size).step()
    out["pooler"]["in_step"] = inside.total
    out["bucket"] = size
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    model = load_model(args.size, None)
    from taste_speech.processing_taste import TasteProcessor
    from taste_speech.tiny import default_tiny_checkpoint

    processor = TasteProcessor.from_pretrained(default_tiny_checkpoint())
    print(f"the audio tower's text side per turn, {args.size} model, CPU ({torch.get_num_threads()} threads), "
          f"median of {args.repeats}; the encoder's states given")
    print("| turn | Whisper tokens (bucket) | eager: operators / host reads / CPU ms | pooler: operators in its "
          "step (one replay on CUDA) + outside it / host reads / CPU ms | operators in one replay / eager's |")
    print("| --- | --- | --- | --- | --- |")
    for label, (seconds, text) in TURNS.items():
        f = figures(model, processor, seconds, text, args.repeats)
        e, p = f["eager"], f["pooler"]
        print(f"| {label} | {f['whisper_tokens']} ({f['bucket']}) | {e['ops']} / {e['host_reads']} / "
              f"{e['cpu_ms']:.1f} | {p['in_step']} + {p['ops'] - p['in_step']} / {p['host_reads']} / "
              f"{p['cpu_ms']:.1f} | {p['in_step'] / e['ops']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
