"""Full-size spoken LM, random weights, Llama base in bfloat16 (the run dtypes on CUDA): the eager
(growing cache) and the fast (static cache) paths against a float32 copy, teacher-forced with the
float32 greedy ids (``gpu_suite.lm_parity``'s comparison, without building the rest of the model).

    python -m benchmarks.lm_parity_full --steps 16              # CPU: ~1 min, ~10 GB of memory
    python -m benchmarks.lm_parity_full --device cuda --steps 64

The tolerance we hold the fast path to: no further from float32 than the eager bf16 path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_suite  # noqa: E402
from taste_speech.modeling_taste import set_spoken_lm_run_dtypes  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    from taste_speech.configuration_taste import TasteConfig
    from taste_speech.modeling_audio_tower import TasteVQ
    from taste_speech.modeling_spoken_lm import TasteSpokenLM

    torch.set_grad_enabled(False)
    started = time.time()
    config = TasteConfig.from_json_file(str(ROOT / "tests" / "data" / "taste_lm_config_full.json"))
    torch.manual_seed(0)
    lm32 = TasteSpokenLM(config).eval().to(args.device)
    lm32.tie_lm_head()
    rvq = TasteVQ(config.audio_tower_config).rvq.eval().to(args.device)
    lm16 = TasteSpokenLM(config).eval().to(args.device)
    lm16.load_state_dict(lm32.state_dict())
    set_spoken_lm_run_dtypes(lm16, torch.bfloat16)  # the Llama base, not its LoRA adapters
    print(f"built in {time.time() - started:.0f} s", flush=True)
    rows = torch.randn(1, 64, config.text_config.hidden_size, generator=torch.Generator().manual_seed(1)).to(args.device)
    ids, reference = gpu_suite.lm_decode_logits(lm32, rvq, gpu_suite.EAGER, rows, None, args.steps)
    scale = max(float(r.abs().max()) for r in reference)
    for path in (gpu_suite.EAGER, gpu_suite.GRAPHED):
        chosen, logits = gpu_suite.lm_decode_logits(lm16, rvq, path, rows, ids, args.steps)
        same = sum(a == b for a, b in zip(ids, chosen))
        diff = max(float((a - b).abs().max()) for a, b in zip(reference, logits))
        print(f"{path.name:8s} bf16 vs float32: same argmax {same}/{args.steps}, largest text-logit difference "
              f"{diff:.3g} (logits up to {scale:.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
