"""``python -m taste_speech.verify DIR [DIR ...]``: run every parity point of golden directories."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from taste_speech.verify import Golden, PointResult

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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dirs", nargs="+", help="golden directories (taste_lm or voice_generator sets)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (goldens: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    failed = 0
    for directory in args.dirs:
        print(f"== {directory}")
        for result in verify(directory):
            print(result.line())
            failed += not result.ok
    print("all parity points match" if not failed else f"{failed} parity point(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
