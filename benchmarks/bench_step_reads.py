"""Reads of tensor values back to the host per spoken-LM decode step, outside the backbone.

On CUDA the backbone's step is a replayed graph; around it each step runs the heads, the sampler,
the audio side of the next row and the next row's embedding. Every value read back to the host
there (``.item()``, ``int()`` / ``bool()`` of a tensor, a mask used as indices, ``unique``) waits
for every kernel queued on the stream before it - with many calls on one GPU, the other calls'
too - and leaves the GPU idle until the host has launched the next kernels. One read per step is
needed: the chosen text token.

This counts those operators (golden set tiny_a, on this CPU, greedy and top-p with a repetition
penalty, 40 steps), per step and per function. On a CPU every read is counted, those of host
tables too; a synchronising copy to the GPU (an id copied from pageable memory) is not seen here:
``tests/test_gpu_graphs.py::test_a_graphed_lm_step_waits_for_the_gpu_once`` counts the waits on a
GPU. ``--root`` counts another checkout of this repository (e.g. ``git worktree add /tmp/before
<commit>``): the baseline of a change, counted by the same code.

    python benchmarks/bench_step_reads.py
    python benchmarks/bench_step_reads.py --root /tmp/before
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from benchmarks.bench_lora_merge import OperatorCount  # noqa: E402 - this checkout's counter, whatever --root
STEP_PARTS = ("heads", "advance_audio", "next_row")  # the spoken LM's; and the sampler's update


def count(root: Path, golden_dir: Path, steps: int = 40) -> dict:
    """{label: (steps, {function: reads per step})} for a greedy and a top-p generation."""
    sys.path.insert(0, str(root))  # (a process counts one checkout: modules imported before stay)
    from taste_speech.modeling_spoken_lm import TasteSpokenLM
    from taste_speech.verify import Golden
    from taste_speech.verify.points_spoken_lm import golden_sampler, load_golden_spoken_lm

    totals: dict[str, int] = {}

    def counted(name, method):
        def wrapper(*args, **kwargs):
            with OperatorCount() as count:
                out = method(*args, **kwargs)
            totals[name] = totals.get(name, 0) + count.reads
            return out
        return wrapper

    golden = Golden(str(golden_dir))
    loaded = load_golden_spoken_lm(golden.dir)
    lm, rvq = loaded.spoken_lm, loaded.audio_tower.vq.rvq
    originals = {name: getattr(TasteSpokenLM, name) for name in STEP_PARTS}
    for name, method in originals.items():
        setattr(TasteSpokenLM, name, counted(name, method))
    try:
        return _generations(lm, rvq, golden, golden_sampler(golden).tables, totals, counted, steps)
    finally:
        for name, method in originals.items():  # (the class is the process's: put it back)
            setattr(TasteSpokenLM, name, method)


def _generations(lm, rvq, golden, tables, totals, counted, steps) -> dict:
    import torch

    from taste_speech.sampler import SamplingParams, TasteSampler

    prompt = {key: golden["in." + key] for key in ("llm_token_ids", "llm_word_ids")}
    prompt["llm_indices"] = golden["a.out.llm_indices"]
    out = {}
    for label, params in (("greedy", SamplingParams(text_top_p=0.0, extra_words=6)),
                          ("top-p 0.8, repetition penalty 1.2",
                           SamplingParams(text_top_p=0.8, text_temperature=0.9, repetition_penalty=1.2, extra_words=6))):
        totals.clear()
        sampler = TasteSampler(tables, params)
        sampler.update = counted("sampler.update", sampler.update)
        with torch.no_grad():
            generated = lm.generate(rvq, sampler, "audio", max_steps=steps, cache_kind="static",
                                    generator=torch.Generator().manual_seed(0), **prompt)
        n = len(generated.trace.action)
        out[label] = (n, {name: totals.get(name, 0) / n for name in (*STEP_PARTS, "sampler.update")})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout whose code is counted")
    parser.add_argument("--golden", type=Path, default=None,
                        help="golden set taste_lm/tiny_a (default: ../shared/reference beside the checkout, "
                             "else the copy in tests/data)")
    args = parser.parse_args(argv)
    golden = args.golden or next((p for p in (HERE.parent / "shared" / "reference" / "taste_lm" / "tiny_a",
                                              HERE / "tests" / "data" / "taste_lm_tiny_a") if p.is_dir()), None)
    if golden is None:
        parser.error("no golden set tiny_a found: give --golden")
    print(f"reads of tensor values per spoken-LM decode step outside the backbone; code of {args.root}")
    print("| sampling | steps | reads per step | heads | sampler.update | advance_audio | next_row |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, (steps, per) in count(args.root.resolve(), golden).items():
        print(f"| {label} | {steps} | {sum(per.values()):.2f} | {per['heads']:.2f} | {per['sampler.update']:.2f} | "
              f"{per['advance_audio']:.2f} | {per['next_row']:.2f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
