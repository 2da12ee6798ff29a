"""Operators of the speech decoder per reply segment: its start against its per-token steps.

Every reply segment (a word, as the agent speaks) starts the speech decoder afresh: the TASTE and
text encoders make the prefix over the previous and the current words, the prefix is fed, and
the previous segment's speech tokens after it. Then one decode step per speech token (on CUDA a
captured step and the sampling). Is the start a lever? This counts the operators dispatched
(views not counted; on CUDA each is at least one kernel, and a captured step is one replay) for
three segments of a reply forced to a fixed script, split into the decode steps and the rest.
Static caches, eager steps on a CPU (the same operators a capture records).

    python benchmarks/bench_segment_ops.py --size full [--root /tmp/before]

``--root`` counts another checkout of this repository (``git worktree add /tmp/before <commit>``)
with this checkout's counter and harness: the figures of the code before a change, in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_suite  # noqa: E402
from benchmarks.bench_lora_merge import OperatorCount  # noqa: E402


def reply_segments(engine, session, forced, count: int) -> list:
    """The first ``count`` one-word segments of the suite's forced reply to its user turn."""
    from taste_speech.streaming import every_n_words, streaming_generate

    script, stop = gpu_suite.reply_script(engine)
    forced.script(script)
    session.conversation.add_turn(session.user_turn(gpu_suite.user_audio(), gpu_suite.USER_TEXT).segment)
    segments = []
    for item in streaming_generate(engine.model, engine.processor, [], text_top_p=0.0, max_length=64, eos_id=stop,
                                   should_emit_segment=every_n_words(1), conversation=session.conversation,
                                   prompt_format=session.conversation.prompt_format):
        if item["segment"] is not None:
            segments.append(item["segment"])
            if len(segments) == count:
                break
    return segments


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="the checkout whose code is counted")
    args = parser.parse_args(argv)
    if args.root is not None:  # before anything imports the library or the plugin (the harness imported neither)
        for path in ("agents", "plugin", ""):
            sys.path.insert(0, str(args.root.resolve() / path))
    from pipecat_taste.session import GenerationSettings

    torch.set_grad_enabled(False)
    # the suite's graphed path: static caches, their steps run eagerly on a CPU
    engine = gpu_suite.path_engine(gpu_suite.build_engine(args.size, "cpu", None), gpu_suite.GRAPHED)
    decoder = engine.model.speech_decoder
    in_steps = {"ops": 0, "reads": 0, "steps": 0}  # the decode steps' operators (their draws too), counted apart
    step = decoder.step

    def counted_step(*args, **kwargs):
        with OperatorCount() as count:
            token = step(*args, **kwargs)
        in_steps["ops"] += count.total
        in_steps["reads"] += count.reads
        in_steps["steps"] += 1
        return token

    with gpu_suite.ForcedReply(engine.model.spoken_lm) as forced:
        session = engine.new_session(GenerationSettings(seed=0, text_top_p=0.0, max_reply_tokens=64))
        segments = reply_segments(engine, session, forced, args.segments)
    state = session.start_speech(gpu_suite.OUT_RATE)
    import pipecat_taste
    import taste_speech

    code = Path(taste_speech.__file__).resolve().parents[1]
    if Path(pipecat_taste.__file__).resolve().parents[2] != code:
        raise RuntimeError(f"the plugin ({pipecat_taste.__file__}) is not from {code}'s checkout")
    print(f"speech decoder operators per reply segment, {args.size} size, CPU (static caches, eager steps); code of {code}")
    print("| segment | speech tokens | decode steps | operators per step | operators outside the steps | "
          "reads outside the steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    decoder.step = counted_step  # (an instance attribute: deleting it brings the class's method back)
    try:
        for i, segment in enumerate(segments):
            in_steps.update(ops=0, reads=0, steps=0)
            with OperatorCount() as everything:
                tokens = sum(len(group) for group in session.speech_tokens(state, segment))
            print(f"| {i} | {tokens} | {in_steps['steps']} | {in_steps['ops'] / in_steps['steps']:.0f} | "
                  f"{everything.total - in_steps['ops']} | {everything.reads - in_steps['reads']} |")
    finally:
        del decoder.step
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
