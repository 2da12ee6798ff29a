"""Spoken-LM decoding cost per generated token: KV cache vs the original no-cache algorithm.

For each context length (rows already in the sequence) it times generation steps exactly as
``TasteSpokenLM.generate`` runs them - text + TASTE heads, TasteSampler decision, next fused row:

* cached: the context is prefilled once (timed separately), then every step feeds ONE row to the
  KV cache and evaluates the heads at the last position only;
* no cache (the original): every step re-runs the whole sequence through the Llama and evaluates
  both heads (the TASTE head's residual search included) on every position.

Models: ``tiny`` = golden set tiny_a (Llama 64-d, 2 layers, 1024 ids); ``full`` = random weights
with the published Llama-3.2-1B dimensions (16 layers, 2048-d, 128 256 ids, LoRA r 64), float32.

    python benchmarks/bench_lm_cache.py                          # tiny + full, 64/256/1024, CPU
    python benchmarks/bench_lm_cache.py --models tiny --steps 50
    python benchmarks/bench_lm_cache.py --models full --device cuda --dtype bfloat16

The full-size run on a small CPU takes minutes (the no-cache step at 1024 rows is a full 1B
forward pass); ``--full-no-cache-steps`` bounds it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from taste_speech.configuration_taste import TasteConfig  # noqa: E402
from taste_speech.modeling_rvq import ResidualVQ  # noqa: E402
from taste_speech.modeling_spoken_lm import TasteSpokenLM  # noqa: E402
from taste_speech.modeling_taste import set_spoken_lm_run_dtypes  # noqa: E402
from taste_speech.sampler import SamplingParams, TasteSampler, VocabularyTables  # noqa: E402
from taste_speech.verify.points_spoken_lm import load_golden_spoken_lm  # noqa: E402

DATA = ROOT / "tests" / "data"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _half(dtype: torch.dtype) -> torch.dtype | None:
    """As the engine runs it: the Llama base in bf16/fp16, the rest float32."""
    return None if dtype == torch.float32 else dtype


def tiny_model(device, dtype):
    loaded = load_golden_spoken_lm(str(DATA / "taste_lm_tiny_a"))
    lm = set_spoken_lm_run_dtypes(loaded.spoken_lm.to(device), _half(dtype))
    return lm, loaded.audio_tower.vq.rvq.to(device)


@torch.no_grad()
def full_model(device, dtype):
    """Published dimensions, random weights (N(0, 0.02); LoRA B non-zero so adapters cost as they do)."""
    config = TasteConfig.from_json_file(str(DATA / "taste_lm_config_full.json"))
    with torch.device("meta"):
        lm = TasteSpokenLM(config)
    lm.to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, param in lm.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    lm.tie_lm_head()
    rotary = lm.backbone.rotary_emb  # non-persistent RoPE tables: rebuild on the device
    with torch.device(device):
        lm.backbone.rotary_emb = type(rotary)(rotary.config)
    lm.round_rope_frequencies()
    lm = set_spoken_lm_run_dtypes(lm, _half(dtype)).eval()
    quant = config.audio_tower_config.kwargs_for_quantizer
    rvq = ResidualVQ(int(quant["dim"]), int(quant["num_quantizers"]), int(quant["codebook_size"]),
                     int(quant["codebook_dim"])).to(device).eval()
    return lm, rvq


def endless_sampler(vocab_size: int) -> TasteSampler:
    """Greedy sampler that never ends by itself (every id a word start, nothing banned)."""
    tables = VocabularyTables(word_start=torch.ones(vocab_size, dtype=torch.bool),
                              sentence_end=torch.zeros(vocab_size, dtype=torch.bool),
                              banned=torch.zeros(vocab_size, dtype=torch.bool))
    return TasteSampler(tables, SamplingParams(text_top_p=0.0, extra_words=10**9))


def context_rows(lm, n: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, lm.vocab_size, (n,), generator=gen).to(device)
    return lm.fuse(lm.token_embeds(ids).float(), lm.pad_audio().expand(n, -1)).unsqueeze(0)


@torch.no_grad()
def time_cached(lm, rvq, rows, steps: int, device) -> tuple[float, float]:
    """(prefill ms, median ms per step)."""
    sampler = endless_sampler(lm.vocab_size)
    sstate = sampler.reset(has_prefix=False)
    state = lm.new_decode_state()
    sync(device)
    t0 = time.perf_counter()
    lm.feed(state, rows)
    sync(device)
    prefill = (time.perf_counter() - t0) * 1000
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        heads = lm.heads(state.last_hidden, rvq)
        decision = sampler.update(sstate, heads.text_logits, heads.taste_logits, state.input_ids)
        state.input_ids.append(decision.text_id)
        lm.advance_audio(state, decision, rvq)
        lm.feed(state, lm.next_row(state, decision.text_id))
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return prefill, statistics.median(times)


@torch.no_grad()
def time_no_cache(lm, rvq, rows, steps: int, device) -> float:
    sampler = endless_sampler(lm.vocab_size)
    sstate = sampler.reset(has_prefix=False)
    state = lm.new_decode_state()
    state.rows.append(rows)
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        heads = lm.reference_heads(state.inputs_embeds(), rvq)
        decision = sampler.update(sstate, heads.text_logits, heads.taste_logits, state.input_ids)
        state.input_ids.append(decision.text_id)
        lm.advance_audio(state, decision, rvq)
        state.rows.append(lm.next_row(state, decision.text_id))
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(models: list[str], contexts: list[int], *, steps: int = 20, no_cache_steps: int = 5,
            full_steps: int = 5, full_no_cache_steps: int = 1, device: str = "cpu", dtype: str = "float32",
            log=print) -> list[dict]:
    """One row per (model, context): prefill ms, cached and no-cache median ms/token, speed-up.
    ``log`` receives each row as a printable line as soon as it is measured (None: silent)."""
    device, torch_dtype = torch.device(device), getattr(torch, dtype)
    say = log or (lambda line: None)
    say(f"device {device}, {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    say(f"{'model':<6} {'context':>7} {'prefill ms':>11} {'cached ms/tok':>14} {'no-cache ms/tok':>16} {'speed-up':>9}")
    rows = []
    for name in models:
        t0 = time.perf_counter()
        lm, rvq = (tiny_model if name == "tiny" else full_model)(device, torch_dtype)
        build = time.perf_counter() - t0
        cached_steps = steps if name == "tiny" else full_steps
        plain_steps = no_cache_steps if name == "tiny" else full_no_cache_steps
        time_cached(lm, rvq, context_rows(lm, 8, device), 2, device)  # warm-up
        for n in contexts:
            rows_in = context_rows(lm, n, device)
            prefill, cached = time_cached(lm, rvq, rows_in, cached_steps, device)
            plain = time_no_cache(lm, rvq, rows_in, plain_steps, device)
            rows.append({"model": name, "context": n, "prefill_ms": prefill, "cached_ms_per_token": cached,
                         "no_cache_ms_per_token": plain, "speedup": plain / cached, "cached_steps": cached_steps,
                         "no_cache_steps": plain_steps, "build_s": build})
            say(f"{name:<6} {n:>7} {prefill:>11.1f} {cached:>14.2f} {plain:>16.2f} {plain / cached:>8.1f}x")
        say(f"  ({name}: built in {build:.1f} s; medians of {cached_steps} cached / {plain_steps} no-cache steps)")
        del lm, rvq
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,full", help="comma list of tiny, full")
    parser.add_argument("--contexts", default="64,256,1024", help="comma list of context lengths (rows)")
    parser.add_argument("--steps", type=int, default=20, help="timed cached steps per context")
    parser.add_argument("--no-cache-steps", type=int, default=5, help="timed no-cache steps per context (tiny)")
    parser.add_argument("--full-steps", type=int, default=5, help="timed cached steps per context (full size)")
    parser.add_argument("--full-no-cache-steps", type=int, default=1, help="timed no-cache steps (full size)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    measure(args.models.split(","), [int(c) for c in args.contexts.split(",")], steps=args.steps,
            no_cache_steps=args.no_cache_steps, full_steps=args.full_steps,
            full_no_cache_steps=args.full_no_cache_steps, device=args.device, dtype=args.dtype,
            log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
