"""The built-in ASR's cost per utterance, split into its parts, for each decoding path:

* features: log-mel of the (30 s padded) audio; encoder: one Whisper encoder pass;
* generate: transformers' ``model.generate`` (dynamic cache, the old path);
* static: our loop (``pipecat_taste.whisper_decode``: preallocated cache, captured step);
* static + draft: the same with a draft holding all but the last ``--tail`` tokens, which is what
  the end of a turn does when the last partial transcript already had the rest (the incremental ASR).
* ``--together`` N turns ending at once (each with its draft, different audio): decoded one after
  another in a one-row workspace, against one batch (``decode_many``) in a workspace of N rows -
  what the transcriber does for calls whose turns end together (``UtteranceBatcher``); with the
  ratio of the two and whether each utterance got the same ids both ways.

Every decode produces a fixed number of tokens (end-of-text suppressed), so random weights do not
change the work. Models: ``tiny`` = the pipeline's random tiny ASR shape (1+1 layers, 32 wide);
``base`` = Whisper-base dimensions (6+6 layers, 512 wide, 51 866 ids); ``large`` = Whisper-large-v3
dimensions (32+32 layers, 1280 wide; slow on a CPU).

    python benchmarks/bench_asr.py                                  # tiny + base on CPU
    python benchmarks/bench_asr.py --models large --device cuda --dtype bfloat16
    python benchmarks/bench_asr.py --models base --together 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "plugin"))

from pipecat_taste.whisper_decode import StaticWhisperDecoder, greedy_plan  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=512, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
    "base": dict(vocab_size=51866, num_mel_bins=80, d_model=512, encoder_layers=6, decoder_layers=6,
                 encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048),
    "large": dict(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=32,
                  encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120),
}


def build(shape: str, tokens: int, device: str, dtype: torch.dtype):
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    dims = SHAPES[shape]
    eos = dims["vocab_size"] - 1
    config = WhisperConfig(**dims, max_source_positions=1500, max_target_positions=448, decoder_start_token_id=0,
                           eos_token_id=eos, pad_token_id=eos, bos_token_id=0, suppress_tokens=[eos],
                           begin_suppress_tokens=[])
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).to(device, dtype).eval()
    model.generation_config.forced_decoder_ids = None
    model.generation_config.max_length = tokens
    return model, WhisperFeatureExtractor(feature_size=dims["num_mel_bins"])


def timed(fn, repeats: int, device: str) -> float:
    """Median milliseconds of ``fn()`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(shape: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    model, extractor = build(shape, args.tokens, args.device, dtype)
    audio = (np.random.default_rng(0).standard_normal(int(args.seconds * 16000)) * 0.1).astype(np.float32)

    def features():
        return extractor(audio, sampling_rate=16000, return_tensors="pt").input_features.to(args.device, dtype)

    feats = features()
    plan = greedy_plan(model)
    decoder = StaticWhisperDecoder(model, plan, args.graph_mode)
    ids, _ = decoder.decode(feats)
    draft = ids[: max(0, len(ids) - args.tail)]
    with torch.inference_mode():
        reference = model.generate(feats)[0].tolist()
        row = {
            "model": shape, "tokens": len(ids), "same_ids_as_generate": ids == reference,
            "features_ms": timed(features, args.repeats, args.device),
            "encoder_ms": timed(lambda: model.model.encoder(feats), args.repeats, args.device),
            "generate_ms": timed(lambda: model.generate(feats), args.repeats, args.device),
        }
    row["static_ms"] = timed(lambda: decoder.decode(feats), args.repeats, args.device)
    row[f"static_draft_tail{args.tail}_ms"] = timed(lambda: decoder.decode(feats, draft), args.repeats, args.device)
    row["graph"] = decoder.captured
    if args.together > 1:
        row.update(together(model, extractor, plan, feats.dtype, args))
    return row


def together(model, extractor, plan, dtype, args) -> dict:
    """N turn ends (different audio, each with its draft): one by one vs one batch."""
    n, rng = args.together, np.random.default_rng(1)
    feats = [extractor((rng.standard_normal(int(args.seconds * 16000)) * 0.1).astype(np.float32),
                       sampling_rate=16000, return_tensors="pt").input_features.to(args.device, dtype) for _ in range(n)]
    alone, batch = StaticWhisperDecoder(model, plan, args.graph_mode), StaticWhisperDecoder(model, plan, args.graph_mode,
                                                                                         rows=n)
    drafts = [ids[: max(0, len(ids) - args.tail)] for ids, _ in (alone.decode(f) for f in feats)]
    utterances = [(f, d, None) for f, d in zip(feats, drafts)]
    one_by_one = [alone.decode(f, d) for f, d, _ in utterances]
    same = batch.decode_many(utterances) == one_by_one
    one_by_one_ms = timed(lambda: [alone.decode(f, d) for f, d, _ in utterances], args.repeats, args.device)
    batch_ms = timed(lambda: batch.decode_many(utterances), args.repeats, args.device)
    return {f"{n}_turns_one_by_one_ms": one_by_one_ms, f"{n}_turns_one_batch_ms": batch_ms,
            "batch/one_by_one": f"{batch_ms / one_by_one_ms:.2f}", "batch_same_ids": same}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "base"], choices=list(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--graph-mode", default="auto", choices=["auto", "eager", "rehearse", "graph"])
    parser.add_argument("--seconds", type=float, default=3.0, help="utterance length")
    parser.add_argument("--tokens", type=int, default=20, help="tokens decoded per utterance")
    parser.add_argument("--tail", type=int, default=4, help="tokens left after the draft")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--together", type=int, default=8, help="turns ending at once (1: not measured)")
    args = parser.parse_args(argv)
    print(f"device {args.device}, {args.dtype}, {args.seconds} s utterance, {args.tokens} tokens, "
          f"torch threads {torch.get_num_threads()}; medians of {args.repeats}", flush=True)
    for i, shape in enumerate(args.models):  # each row as it is measured: a run cut short keeps the rows before
        row = measure(shape, args)
        if i == 0:
            print("| " + " | ".join(row) + " |")
            print("|" + "---|" * len(row))
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
