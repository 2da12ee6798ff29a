"""``python -m taste_speech.verify DIR [DIR ...]``: run every parity point of golden directories.

Exit codes: 0 = all parity points match, 1 = a parity point failed, 2 = a DIR is not a golden
reference directory (no io.safetensors; use tests/data/taste_lm_tiny_a or
tests/data/voice_generator_tiny_a) or one of its files cannot be read.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from taste_speech.verify import Golden, NotGoldenDirError, PointResult, require_golden_dir

# Parity modules per kind of golden directory, in pipeline order.
PARTS = {
    "taste_lm": ["points_audio_tower", "points_spoken_lm", "points_speech_decoder"],
    "voice_generator": ["points_voice_generator"],
}


def load_model(golden: Golden):
    if golden.kind == "voice_generator":
        from taste_speech.voice_generator import VoiceGenerator

        return VoiceGenerator.from_golden_dir(golden.dir)
    from taste_speech.modeling_taste import TasteForCausalLM

    return TasteForCausalLM.from_pretrained(golden.dir, torch_dtype=torch.float32).eval()


def verify(directory: str) -> list[PointResult]:
    golden = Golden(directory)
    model = load_model(golden)
    results: list[PointResult] = []
    with torch.inference_mode():
        for part in PARTS[golden.kind]:
            module = importlib.import_module(f"taste_speech.verify.{part}")
            results.extend(module.run(golden, model))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taste_speech.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="golden directories (taste_lm or voice_generator sets)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (goldens: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Every directory first: a wrong one fails at once, not after the others ran, and with its own code.
    for directory in args.dirs:
        try:
            require_golden_dir(directory)
        except NotGoldenDirError as exc:
            print(f"ERROR: {exc}", file=sys.stderr)
            return 2
    failed = 0
    for directory in args.dirs:
        print(f"== {directory}")
        try:
            results = verify(directory)
        except Exception as exc:  # an unreadable golden file or checkpoint: not a failed parity point
            print(f"ERROR: cannot run the parity points of {directory} ({type(exc).__name__}: "
                  f"{' '.join(str(exc).split())[:400]}); copy the golden folder again", file=sys.stderr)
            return 2
        for result in results:
            print(result.line())
            failed += not result.ok
    print("all parity points match" if not failed else f"{failed} parity point(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
