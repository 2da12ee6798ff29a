"""Run the benchmark suite and write BENCHMARKS.md (plots and raw JSON under benchmarks/results/).

    python benchmarks/run_all.py                 # everything, tiny + full size (~25 min on 2 CPU cores)
    python benchmarks/run_all.py --quick         # tiny only, short runs (a few minutes)
    python benchmarks/run_all.py --device cuda --dtype bfloat16 --out benchmarks/results/gpu.md
    python benchmarks/run_all.py --quick --sections lm --out /tmp/b.md   # one section

Sections: first audio streaming vs batch (``first_audio``), LM ms/token vs context (``lm``),
synthesis chunk latency vs position (``synthesis``), memory and first audio with concurrent calls
(``concurrency``, CPU only). Every ratio compares figures measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

import torch  # noqa: E402

from benchmarks import bench_batched_steps, bench_early_reply, report, soak  # noqa: E402
from benchmarks.report import fmt, ratio, table  # noqa: E402

SECTIONS = ("first_audio", "lm", "synthesis", "concurrency")


@dataclass
class Plan:
    """How much of each section a mode runs."""

    sizes: tuple[str, ...]
    reply_tokens: dict  # size -> max_reply_tokens (full size: few, the CPU needs minutes per reply)
    first_audio_repeats: dict  # size -> runs per mode (the median run is reported)
    lm_contexts: tuple[int, ...]
    lm_steps: int
    lm_no_cache_steps: int
    lm_full_steps: int
    lm_full_no_cache_steps: int
    synth: tuple[tuple[str, float, int], ...]  # (size, seconds, re-run every k-th chunk)
    seam_seconds: float  # 0: no seam table
    calls: tuple[int, ...]
    call_reply_tokens: int


QUICK = Plan(sizes=("tiny",), reply_tokens={"tiny": 16}, first_audio_repeats={"tiny": 1}, lm_contexts=(64, 256, 1024), lm_steps=10, lm_no_cache_steps=3,
             lm_full_steps=0, lm_full_no_cache_steps=0, synth=(("tiny", 4.0, 1),), seam_seconds=0.0,
             calls=(1, 2), call_reply_tokens=8)
FULL = Plan(sizes=("tiny", "full"), reply_tokens={"tiny": 16, "full": 4}, first_audio_repeats={"tiny": 3, "full": 1}, lm_contexts=(64, 256, 1024), lm_steps=20, lm_no_cache_steps=5,
            lm_full_steps=3, lm_full_no_cache_steps=1, synth=(("tiny", 20.0, 1), ("full", 6.0, 3)), seam_seconds=6.0,
            calls=(1, 2, 4, 8), call_reply_tokens=8)


def link(args, path: Path) -> str:
    """``path`` relative to the markdown file (links work wherever --out puts it)."""
    return Path(os.path.relpath(path, Path(args.out).resolve().parent)).as_posix()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- 1. first audio -----------------------------------------------------------------------------------
def section_first_audio(plan: Plan, args, results: Path) -> tuple[list[str], dict]:
    from benchmarks import engines, first_audio
    from pipecat_taste.session import GenerationSettings
    from taste_agents.caller import load_utterances

    utterance = load_utterances()["hello"]
    data, md = {}, []
    for size in plan.sizes:
        log(f"first audio: building the {size} engine")
        t0 = time.perf_counter()
        engine = (engines.tiny_engine if size == "tiny" else engines.full_engine)(args.device, args.run_dtype)
        build_s = time.perf_counter() - t0
        n_model, n_vg = engines.parameter_count(engine)
        log(f"first audio: {size} ({n_model:.0f} M + {n_vg:.0f} M parameters, built in {build_s:.0f} s)")
        # The full-size audio tower is a Whisper encoder over a 30 s window: slow on a CPU, and the
        # same work in every mode, so it is timed only once there.
        settings = GenerationSettings(max_reply_tokens=plan.reply_tokens[size], words_per_segment=1, seed=0)
        r = first_audio.measure(engine, utterance, settings, tokenize_repeats=2 if size == "tiny" else 0,
                                repeats=plan.first_audio_repeats[size])
        r.update(size=size, parameters_m=[n_model, n_vg], build_s=build_s)
        data[size] = r
        log(f"first audio {size}: " + ", ".join(f"{m['mode']} {m['first_audio_ms']:.0f} ms" for m in r["modes"]))
        del engine
    md += first_audio_markdown(data, plan, utterance)
    series = [(m["mode"], list(range(len(plan.sizes))), [data[s]["modes"][i]["first_audio_ms"] for s in plan.sizes])
              for i, m in enumerate(data[plan.sizes[0]]["modes"])]
    png = report.plot_bars(results / "first_audio.png", [s for s in plan.sizes], series,
                           title="First audio after the user's turn (turn already tokenized)", ylabel="ms", logy=True)
    md += ["", f"![first audio]({link(args, png)})"]
    return md, data


def first_audio_markdown(data: dict, plan: Plan, utterance) -> list[str]:
    md = ["## 1. First audio after the end of the user's turn: streaming vs batch", "",
          f"The user's turn is the caller recording `hello.wav` ({utterance.seconds:.1f} s, \"{utterance.text}\"). "
          "The clock starts once the turn is tokenized (the audio tower, the same work in every mode, is a row "
          "of its own) and stops at the first audio sample. Same weights, same reply, same speech tokens in "
          "all three modes (fresh sessions with seed 0; the reply's ids and speech tokens are compared, "
          "see the `same reply` line). Random weights: the reply length is what the sampler's end rules gave "
          "within `max_reply_tokens` (per size below); it is the same for every mode. A segment's speech "
          "tokens end where the sampled end token or the decoder's length limit (20 speech tokens, 0.4 s, per "
          "row of its prefix: the segment's ASR tokens + 3) ends them: with random weights the audio is longer "
          "than a trained model's, and the same in every mode.", "",
          "* **streaming, threaded** - the plugin's arrangement: LM, speech decoder and vocoder in three threads "
          "with bounded queues; one word per segment, 'low_latency' emission policy; first audio = the first "
          "non-empty vocoder chunk.",
          "* **streaming, sequential** - the same engine calls in one thread, depth-first (a new word goes through "
          "the speech decoder and the vocoder before the LM's next step): the first-audio path without the other "
          "stages competing for the 2 cores; its busy times give the per-stage real-time factors.",
          "* **batch** - the baseline: the whole reply, then all its speech tokens (segment by segment, as the "
          "engine decodes them), then whole-utterance flow + HiFT (`VoiceGenerator.inference`); first audio = "
          "when everything is done.", ""]
    for size, r in data.items():
        batch = next(m for m in r["modes"] if m["mode"] == "batch")
        md += [f"### {size} ({r['parameters_m'][0]:.0f} M TASTE + {r['parameters_m'][1]:.0f} M voice generator "
               "parameters" + (", random weights" if size == "full" else ", embedded tiny checkpoint") + ")", ""]
        tok = r["tokenize_ms"]
        tok_note = (f"median of {r['tokenize_repeats']} after a first call of {r['tokenize_first_ms']:.0f} ms"
                    if r["tokenize_repeats"] else "one call, not repeated")
        rows = []
        for m in r["modes"]:
            rows.append([m["mode"], m["first_audio_ms"], m["first_audio_ms"] + tok, ratio(batch["first_audio_ms"],
                         m["first_audio_ms"]), m["total_ms"], m["audio_s"], m["speech_tokens"],
                         " / ".join(f"{v:.0f}" for v in m["first_audio_ms_runs"])])
        md += [f"{r['repeats']} run(s) per mode, interleaved; each row is the mode's median run (by first audio).", "",
               table(["mode", "first audio ms (turn tokenized)", "first audio ms (incl. tokenizing the turn)",
                      "vs batch (x sooner)", "last audio ms", "audio s", "speech tokens", "first audio ms, every run"],
                     rows, digits=1), "",
               f"Tokenizing the user's turn (audio tower, {r['user_audio_s']:.1f} s of audio, {r['user_turn_tokens']} "
               f"text tokens): **{tok:.0f} ms** ({tok_note}); the same in every mode.", "",
               f"Reply: {r['modes'][0]['reply_tokens']} LLM tokens (max_reply_tokens {r['max_reply_tokens']}), "
               f"{r['modes'][0]['reply_words']} words; same reply "
               f"in all modes: {fmt(r['same_reply'])}; same speech tokens: {fmt(r['same_speech_tokens'])}. "
               f"Engine built in {r['build_s']:.0f} s.", "",
               "Real-time factor per stage = compute time of the stage / seconds of audio produced (below 1 = "
               "faster than real time). The threaded row's busy times include waiting for the CPU while the "
               "other stages run (2 cores), so its RTFs are upper bounds.", ""]
        rows = [[m["mode"], m["busy_s"]["lm"], m["busy_s"]["speech_decoder"], m["busy_s"]["vocoder"], m["audio_s"],
                 m["rtf"]["lm"], m["rtf"]["speech_decoder"], m["rtf"]["vocoder"]] for m in r["modes"]]
        md += [table(["mode", "LM s", "speech decoder s", "flow+HiFT s", "audio s", "RTF LM", "RTF speech decoder",
                      "RTF flow+HiFT"], rows, digits=2), ""]
    return md


# -- 2. LM ms/token -------------------------------------------------------------------------------------
def section_lm(plan: Plan, args, results: Path) -> tuple[list[str], dict]:
    from benchmarks import bench_lm_cache

    models = ["tiny"] + (["full"] if "full" in plan.sizes else [])
    kwargs = dict(steps=plan.lm_steps, no_cache_steps=plan.lm_no_cache_steps, full_steps=max(1, plan.lm_full_steps),
                  full_no_cache_steps=max(1, plan.lm_full_no_cache_steps), device=args.device, dtype=args.dtype)
    rows = bench_lm_cache.measure(models, list(plan.lm_contexts), log=lambda line: log("lm: " + line), **kwargs)
    cmd = (f"python benchmarks/bench_lm_cache.py --models {','.join(models)} "
           f"--contexts {','.join(map(str, plan.lm_contexts))} --steps {plan.lm_steps} "
           f"--no-cache-steps {plan.lm_no_cache_steps} --full-steps {kwargs['full_steps']} "
           f"--full-no-cache-steps {kwargs['full_no_cache_steps']} --device {args.device} --dtype {args.dtype}")
    md = ["## 2. Spoken-LM ms per generated token vs context: KV cache vs no cache", "",
          "Per step: text + TASTE heads, the sampler's decision, the next fused row. Cached: the context is "
          "prefilled once (its own column), then one row per step through the KV cache, heads at the last "
          "position only. No cache (the original algorithm, the baseline): every step re-runs the whole "
          "sequence and both heads on every position. `full` = published Llama-3.2-1B dimensions (16 layers, "
          "2048-d, 128 256 ids, LoRA r 64), random weights. Medians of the step counts given.", "",
          f"Same figures alone: `{cmd}`", ""]
    md.append(table(["model", "context rows", "prefill ms", "cached ms/token", "no-cache ms/token",
                     "speed-up (x)", "steps cached / no-cache"],
                    [[r["model"], r["context"], r["prefill_ms"], r["cached_ms_per_token"], r["no_cache_ms_per_token"],
                      r["speedup"], f"{r['cached_steps']} / {r['no_cache_steps']}"] for r in rows], digits=2))
    series = []
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        series.append((f"{model} cached", [r["context"] for r in mine], [r["cached_ms_per_token"] for r in mine]))
        series.append((f"{model} no cache", [r["context"] for r in mine], [r["no_cache_ms_per_token"] for r in mine]))
    png = report.plot_lines(results / "lm_ms_per_token.png", series, title="Spoken LM: ms per generated token",
                            xlabel="context (rows)", ylabel="ms / token", logy=True)
    md += ["", f"![LM ms per token]({link(args, png)})"]
    return md, {"rows": rows}


# -- 3. synthesis ---------------------------------------------------------------------------------------
def section_synthesis(plan: Plan, args, results: Path) -> tuple[list[str], dict]:
    from benchmarks import bench_synthesis
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    md = ["## 3. Synthesis chunk latency vs position in the utterance: streaming vs re-run", "",
          "Random speech tokens are streamed into the voice generator one at a time (as the speech decoder "
          "produces them). Per chunk: the compute time of that chunk in the streaming synthesizer, next to the "
          "baseline that re-synthesises the whole utterance so far (flow + HiFT on all committed tokens, "
          "keeping only the new audio: what stateless synthesis costs at that point).", ""]
    data, series = {}, []
    for size, seconds, every in plan.synth:
        ns = argparse.Namespace(checkpoint=None, golden=None, size=size, device=args.device)
        vg = bench_synthesis.load_model(ns)
        if args.device.startswith("cuda") and args.dtype != "float32":
            log("synthesis: the voice generator runs in float32 (its streaming state is float32)")
        vocab, spk_dim = vg.flow.vocab_size, vg.flow.spk_embed_affine_layer.in_features
        speaker = torch.randn(1, spk_dim, generator=torch.Generator().manual_seed(3)).to(args.device)
        tokens = torch.randint(0, vocab, (1, int(seconds * 50)), generator=torch.Generator().manual_seed(0))
        n_params = sum(p.numel() for p in vg.parameters()) / 1e6
        cmd = (f"python benchmarks/bench_synthesis.py --size {size} --seconds {seconds:g} --rerun-every {every} "
               f"--threads {torch.get_num_threads()} --device {args.device} --skip-seams")
        md += [f"### {size} voice generator ({n_params:.0f} M parameters, random weights), {seconds:g} s utterance", "",
               f"Same figures alone: `{cmd}`", ""]
        data[size] = []
        for regime in ("low_latency", "quality"):
            policy = EmissionPolicy.resolve(regime)
            log(f"synthesis: {size} {regime}, {seconds:g} s")
            out = bench_synthesis.latency_rows(vg, tokens.to(args.device), speaker, policy, every, args.device)
            rows = out["rows"]
            stream_total = sum(r["stream_ms"] for r in rows) / 1000
            data[size].append({"regime": regime, "rows": rows, "audio_s": out["audio_s"]})
            shown = [r for r in rows if r["rerun_ms"] is not None]
            if len(shown) > 12:  # keep the table short; the plot has every chunk
                step = -(-len(shown) // 10)
                shown = [r for i, r in enumerate(shown) if i % step == 0 or r is shown[-1]]
            timed = [r for r in rows if r["rerun_ms"] is not None]
            md += [f"**{regime}** (first chunk {policy.first_chunk_tokens} tokens + {policy.lookahead_tokens} lookahead, "
                   f"then {policy.chunk_tokens} per chunk): {len(rows)} chunks, streaming total "
                   f"{stream_total:.2f} s for {out['audio_s']:.1f} s of audio (RTF {stream_total / out['audio_s']:.2f}); "
                   f"streaming ms per chunk: first {rows[0]['stream_ms']:.0f}, median "
                   f"{statistics.median(r['stream_ms'] for r in rows):.0f}, last {rows[-1]['stream_ms']:.0f}; "
                   f"re-run-all: first {timed[0]['rerun_ms']:.0f}, last {timed[-1]['rerun_ms']:.0f}.",
                   "",
                   table(["chunk k", "tokens fed", "tokens committed", "audio ms", "streaming ms", "re-run-all ms",
                          "re-run / streaming (x)"],
                         [[r["k"], r["tokens_fed"], r["tokens_committed"], r["audio_ms"], r["stream_ms"], r["rerun_ms"],
                           ratio(r["rerun_ms"], r["stream_ms"])] for r in shown]), ""]
            series.append((f"{size} {regime} streaming", [r["k"] for r in rows], [r["stream_ms"] for r in rows]))
            series.append((f"{size} {regime} re-run all", [r["k"] for r in timed], [r["rerun_ms"] for r in timed]))
        if plan.seam_seconds and size == "tiny":
            md += seam_markdown(bench_synthesis, vg, speaker, plan.seam_seconds, vocab)
        del vg
    png = report.plot_lines(results / "synthesis_chunk_latency.png", series, title="Synthesis: compute ms per chunk",
                            xlabel="chunk index k", ylabel="ms", logy=True)
    md += [f"![synthesis chunk latency]({link(args, png)})"]
    return md, data


def seam_markdown(bench_synthesis, vg, speaker, seconds: float, vocab: int) -> list[str]:
    log(f"synthesis: seams over {seconds:g} s")
    seams = bench_synthesis.seam_rows(vg, speaker, seconds, [25], vocab)
    rows = [[s.policy, s.chunk_tokens, s.first_audio_after_tokens, s.first_chunk_ms, s.mel_dist_junction,
             s.mel_dist_elsewhere, s.wave_jump_junction_max, s.wave_jump_p999, s.length_diff_samples] for s in seams]
    return [f"Seams (tiny voice generator, {seconds:g} s, chunk 25 tokens; streamed vs offline synthesis of the same "
            "tokens and noise; `python benchmarks/bench_synthesis.py --skip-latency --seam-seconds "
            f"{seconds:g} --chunk-sizes 25`):", "",
            table(["regime", "chunk tokens", "first audio after tokens", "first chunk audio ms", "mel dist at junctions",
                   "mel dist elsewhere", "max wave jump at junctions", "wave jump p99.9", "length diff (samples)"],
                  rows, digits=3), ""]


# -- 4. concurrency -------------------------------------------------------------------------------------
def section_concurrency(plan: Plan, args, results: Path) -> tuple[list[str], dict]:
    from benchmarks import concurrency

    rows = concurrency.measure(list(plan.calls), results, max_reply_tokens=plan.call_reply_tokens,
                               threads=torch.get_num_threads(), log=lambda line: log("concurrency: " + line))
    base = rows[0]
    md = ["## 4. Memory per call and first audio with concurrent calls", "",
          "Tiny checkpoint, in-process simulated calls (`taste_agents.load.concurrent_calls`): the full Pipecat "
          "pipeline per call, real-time audio both ways, the scripted caller (4 utterances, one barge-in), "
          f"`max_reply_tokens={plan.call_reply_tokens}`. Each N runs in a fresh process: engine loaded and warmed "
          "up, idle RSS recorded, then N calls at once (started 0.37 s apart). Memory per call = (peak RSS - "
          "idle RSS) / N. First audio is measured on each call's recording from the end of the caller's speech, "
          "so it includes the 0.3 s oracle-STT delay and the wait for the VAD to confirm the end of the turn "
          "(0.5 s of silence): the reply is made early, after 0.2 s of silence, and heard once the VAD confirms "
          "(early replies: handed on early; taken back: the caller went on after a short pause). Ratios compare "
          f"with {base['calls']} call(s) in the same run.", "",
          f"Same figures alone: `python -m benchmarks.concurrency --calls N --json out.json --max-reply-tokens "
          f"{plan.call_reply_tokens}`", ""]
    table_rows = []
    for r in rows:
        table_rows.append([r["calls"], r["idle_rss_mb"], r["peak_rss_mb"], r["memory_per_call_mb"],
                           r["first_audio_ms_median"], r["first_audio_ms_p90"], r["first_audio_ms_max"],
                           ratio(r["first_audio_ms_median"], base["first_audio_ms_median"]),
                           f"{r['answered_turns']}/{r['turns']}", f"{r['early_replies']} ({r['early_turns_retracted']})",
                           len(r["crashes"]), r["audio_intact"]])
    md.append(table(["calls at once", "idle RSS MiB", "peak RSS MiB", "MiB per call", "first audio median ms",
                     "p90 ms", "max ms", f"median vs {base['calls']} call (x slower)", "turns answered",
                     "early replies (taken back)", "crashes",
                     "audio intact"], table_rows))
    png = report.plot_lines(results / "concurrency_rss.png",
                            [(f"{r['calls']} call(s)", [t for t, _ in r["rss_mb"]], [mb for _, mb in r["rss_mb"]])
                             for r in rows], title="Process RSS during the calls", xlabel="s", ylabel="MiB")
    md += ["", f"![RSS over time]({link(args, png)})"]
    return md, {"rows": rows}


# -- the document -----------------------------------------------------------------------------------------
def gpu_markdown(args, kept: dict[str, list[str]]) -> list[str]:
    """Section 5: this run's device on CUDA; on a CPU the document's own section 5 when it holds
    measurements from a GPU machine (written by hand from ``benchmarks/results``), else how to measure."""
    md = ["## 5. GPU", ""]
    if args.device.startswith("cuda"):
        return md + [GPU_MEASURED_HERE.format(device=torch.cuda.get_device_name(0), dtype=args.dtype)]
    body = next((line for line in kept.get("5", [])[1:] if line.strip()), "")
    written_by_this_runner = body.startswith((GPU_HOWTO[0][:30], GPU_MEASURED_HERE[:30]))
    if body and not written_by_this_runner:
        return kept["5"]
    return md + GPU_HOWTO


SECTION_TITLE = re.compile(r"^## (\d+[a-z]?)\. ")


def existing_sections(path: Path) -> dict[str, list[str]]:
    """The sections ("## <number>. title" and their lines, up to the next such title outside a
    code block) of the document at ``path``, by number; a number seen twice keeps both bodies."""
    sections: dict[str, list[str]] = {}
    current, in_code = None, False
    for line in (path.read_text().split("\n") if path.exists() else []):
        if line.startswith("```"):
            in_code = not in_code
        title = None if in_code else SECTION_TITLE.match(line)
        if title:
            current = title.group(1)
            if current in sections:  # a repeated number: keep its body with the first one's
                sections[current].append("")
                continue
            sections[current] = []
        if current is not None:
            sections[current].append(line)
    return {number: "\n".join(lines).rstrip().split("\n") for number, lines in sections.items()}


GPU_MEASURED_HERE = "These figures were measured on {device} in {dtype}."
GPU_HOWTO = [
    "No GPU was available for these figures (CPU only); none are given for a GPU. On a CUDA machine "
    "`bash benchmarks/run_gpu.sh` runs the CUDA-graph parity tests (`tests/test_gpu_graphs.py`), the real-time "
    "suite `python -m benchmarks.gpu_suite` (eager vs graphed: first audio after the user's turn per stage at real "
    "size in bfloat16, LM and speech-decoder ms/token at 64 and 1024 context, flow and vocoder ms per chunk, "
    "whole-reply RTF, peak GPU memory per call and first audio with 1-16 concurrent calls, bf16 parity against "
    "float32) into `benchmarks/results/gpu_suite.md`, then this suite in bfloat16 into "
    "`benchmarks/results/gpu.md`. The fast path itself is described in [docs/GPU.md](docs/GPU.md).",
    "", "```", "bash benchmarks/run_gpu.sh", "```", "",
    "On a lent GPU machine with minutes to spare, `bash benchmarks/device_check.sh OUT_DIR 540` runs the parity "
    "tests and then the suite's parts in order of importance under a time budget, writing each table as soon as "
    "it is measured (docs/GPU.md, \"Measuring\").",
]


def write_document(path: Path, command: str, facts: dict, parts: list[list[str]], args, wall_s: float) -> None:
    load = facts.get("load_average_at_start") or (0.0, 0.0, 0.0)
    busy = max(load[:2]) > 0.5 * (facts["cores"] or 1)
    md = ["# Benchmarks", "",
          f"Written by `{command}` (wall time {wall_s / 60:.1f} min). Regenerate with the same command; "
          "`--quick` runs the tiny model only.", "", "Machine:", ""] + report.facts_lines(facts)
    md += ["", ("**The machine was shared while these figures were taken** (other processes kept the load average "
                "near or above the core count), so absolute times are inflated and noisier than on an idle "
                "machine; ratios inside one section were measured back to back and are the more reliable figures. "
                "With 2 intra-op threads on 2 shared cores, another process's burst stalls every parallel op (the "
                "op's threads wait for each other), which hits the tiny model's many small ops hardest: the same "
                "tiny figure can differ several-fold between runs (see the spread in the \"every run\" column of "
                "section 1). Read absolute times as upper bounds and compare the rows of one table."
                if busy else "The machine was otherwise idle while sections 1-4 ran (load average below half the core "
                "count); the sections written by their own commands (4b, 6, 7) give their own machine line."),
           "", "Models with random weights give noise-like audio; latency depends on the sizes, not on the values. "
           "`tiny` = the embedded tiny checkpoint (`taste_speech.tiny.default_tiny_checkpoint()`); `full` = the "
           "published dimensions (`tests/data/taste_lm_config_full.json`, full-size flow + HiFT) with random "
           "weights, the tiny checkpoint's tokenizers, float32.", ""]
    # Sections this run did not measure stay as the document has them (the sections written by
    # hand from other commands' results, 8 onwards, and those of the --sections left out).
    sections = existing_sections(path)
    measured = {section_number(part) for part in parts}
    kept = [number for number in ("1", "2", "3", "4") if number in sections and number not in measured]
    if kept:
        md += [f"Sections {', '.join(kept)} were not measured by this run: they are kept as the previous document "
               "had them (measured by an earlier run, on its machine).", ""]
    for part in parts:
        sections[section_number(part)] = part
    written_elsewhere = (bench_batched_steps.benchmarks_section(), soak.benchmarks_section(),
                         bench_early_reply.benchmarks_section())  # from their saved results, when there are any
    for section in written_elsewhere:
        if section:
            sections[section_number(section)] = section
    sections["5"] = gpu_markdown(args, sections)
    for number in sorted(sections, key=section_order):
        md += sections[number] + [""]
    path.write_text("\n".join(md).rstrip() + "\n")


def section_number(lines: list[str]) -> str:
    """ "4b" for a section titled "## 4b. ..." """
    return SECTION_TITLE.match(lines[0]).group(1)


def section_order(number: str) -> tuple[int, str]:
    digits = "".join(c for c in number if c.isdigit())
    return (int(digits) if digits else 10**6, number)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only, short runs")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="the markdown file to write")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="plots and JSON go here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    args = parser.parse_args(argv)
    args.run_dtype = None if args.dtype == "float32" else args.dtype
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
    if args.device.startswith("cuda") and "concurrency" in sections:
        sections.remove("concurrency")  # process RSS says nothing about GPU memory
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    plan = QUICK if args.quick else FULL
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/run_all.py" + ("" if argv is None and not sys.argv[1:] else " " + shlex.join(
        argv if argv is not None else sys.argv[1:]))
    facts = report.machine_facts(args.device, args.dtype)
    started = time.perf_counter()
    runners = {"first_audio": section_first_audio, "lm": section_lm, "synthesis": section_synthesis,
               "concurrency": section_concurrency}
    parts, raw = [], {"facts": facts, "command": command}
    for name in SECTIONS:
        if name in sections:
            log(f"section {name}")
            md, data = runners[name](plan, args, results)
            parts.append(md)
            raw[name] = data
    facts["load_average_at_end"] = report.load_average()
    wall = time.perf_counter() - started
    out = Path(args.out)
    write_document(out, command, facts, parts, args, wall)
    (results / f"{out.stem.lower()}.json").write_text(json.dumps(raw, indent=1, default=str))
    log(f"wrote {out} in {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
