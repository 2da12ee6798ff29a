"""The real-time suite's harness (benchmarks/gpu_suite.py) at tiny size on CPU: every stage is
timed, the first audio is the sum of its stages, the reply is forced to its 12 words, both paths
agree with float32, the levers run against their baselines, concurrent calls run on every path
(with the LM steps batched across calls too), and the markdown holds the tables. (Its figures matter on a GPU only.)"""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_suite  # noqa: E402


def test_quick_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_suite.md"
    parts = [p for p in gpu_suite.PARTS if p != "compiled_flow"]  # (inductor needs a C compiler: its own test)
    assert gpu_suite.main(["--device", "cpu", "--size", "tiny", "--quick", "--dtype", "float32",
                           "--calls", "1,2", "--parts", ",".join(parts), "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    for name in ("eager", "graphed"):
        path = data["paths"][name]
        first = path["first_audio"]
        assert set(first["stages"]) == set(gpu_suite.STAGES)
        assert all(ms > 0 for ms in first["stages"].values())
        assert abs(first["first_audio_ms"] - sum(first["stages"].values())) < 1e-6
        assert first["reply_words"] == 12 and first["audio_s"] > 1.0 and first["rtf"] > 0
        # the whole reply's stages: the first audio's, and the rest of the reply's LM, speech decoder and synthesis
        reply = first["reply_stages"]
        assert set(reply) == set(gpu_suite.STAGES) | {"lm_rest", "speech_decoder_rest", "synthesis_rest"}
        assert all(reply[stage] >= first["stages"][stage] for stage in gpu_suite.STAGES)
        assert sum(reply.values()) == pytest.approx(first["total_ms"])
        assert all(ms > 0 for ms in path["lm_ms_per_token"].values())
        assert all(ms > 0 for ms in path["speech_decoder_ms_per_token"].values())
        assert path["synthesis"]["chunks"] > 2 and 0 < path["synthesis"]["flow_first_ms"] < path["synthesis"]["first_ms"]
        assert path["synthesis"]["steady_tokens"] == 25
        if name == "graphed":  # every bucket of the timed utterance was made (captured) before its timing
            made = path["synthesis"]["buckets_made_while_timed"]
            assert set(made) == {"flow", "vocoder"} and made == {"flow": [], "vocoder": []}
        parity = data["lm_parity"][name]
        assert parity["same_argmax"] == data["lm_parity"]["steps"] and parity["max_logit_diff"] < 1e-4
    graphed = data["paths"]["graphed"]
    for rows in (data["paths"]["eager"]["concurrency"], graphed["concurrency"], graphed["concurrency_batched"]):
        assert [r["calls"] for r in rows] == [1, 2]
        assert all(0 < r["first_audio_median_ms"] <= r["first_audio_max_ms"] for r in rows)
    for key in ("lm_batch", "speech_batch"):
        stats = graphed[key]
        assert stats["steps"] > 0 and stats["rows_stepped"] >= stats["steps"] and stats["slots_in_use"] == 0
    synthesis = graphed["synthesis_batch"]
    assert synthesis["rows"] == 16 and all(synthesis[s]["windows"] >= synthesis[s]["steps"] > 0 for s in ("flow", "vocoder"))
    # every call's first flow window was announced (start_speech) and counted; a CPU has no tower graph
    shared = [row["shared"] for row in graphed["concurrency_batched"]]
    assert [row["first_windows"] for row in shared] == [1, 2] and all("tower_passes" not in row for row in shared)
    assert [row["first_window_steps"] for row in shared][0] == 1 and 1 <= shared[1]["first_window_steps"] <= 2
    assert "How the calls' first-audio work was shared" in out.read_text()
    for row in graphed["concurrency"] + graphed["concurrency_batched"]:  # where each row's first audio went
        stages = row["stages_median_ms"]
        assert set(stages) == set(gpu_suite.STAGES) and all(ms > 0 for ms in stages.values())
        assert sum(stages.values()) <= 1.5 * row["first_audio_max_ms"]
    assert "Where the first audio of concurrent calls went" in out.read_text()
    levers = data["levers"]
    assert 0 < levers["lm_ms_per_token"]["merged"] and 0 < levers["lm_ms_per_token"]["side"]
    assert levers["tower_encoder_ms"]["eager"] > 0 and levers["tower_encoder_ms"]["graph"] > 0
    assert levers["tower_encoder_ms"]["graph_scores_written"] > 0
    assert levers["tower_text_ms"]["eager"] > 0 and levers["tower_text_ms"]["graph"] > 0
    assert "text side one captured step per length bucket (eager)" in out.read_text()
    assert levers["prefill_ms"]["eager"] > 0 and levers["prefill_ms"]["graph"] > 0
    assert levers["window_prefill_ms"]["rows"] == 3072 and levers["window_prefill_ms"]["graph"] > 0
    assert "| spoken LM prefill ms (the 3072 rows kept after a window move, between turns) |" in out.read_text()
    assert [row["frames"] for row in levers["first_chunk_flow"]] == [17, 37]
    assert all(row["max_mel_diff"] < 1e-4 and row["full_ops"] < row["padded_ops"] for row in levers["first_chunk_flow"])
    assert levers["synthesis"]["growing"]["chunks"] < levers["synthesis"]["fixed"]["chunks"]
    # widened windows: only the second chunk cannot reach back far enough to fill an unpadded size
    narrow, growing = levers["synthesis"]["narrow"], levers["synthesis"]["growing"]
    assert narrow["chunks"] == growing["chunks"] and growing["padded_flow_windows"] <= 1 < narrow["padded_flow_windows"]
    assert [(row["frames"], row["padded"]) for row in levers["flow_kernels"]] == [(17, False), (87, True)]
    assert all(row["now_ops"] < row["baseline_ops"] and row["max_mel_diff"] < 1e-5 and row["now_ms"] > 0
               for row in levers["flow_kernels"])
    assert [(row["frames"], row["padded"]) for row in levers["time_conditioning"]] == [(17, False), (87, True)]
    assert all(row["now_ops"] < row["baseline_ops"] and row["max_mel_diff"] < 1e-4 for row in levers["time_conditioning"])
    # longer steady chunks: fewer of them for the same reply, each window on a bucket up to 640 frames
    limits = data["chunk_limits"]
    replies = limits["replies"]
    assert [r["max_chunk_tokens"] for r in replies] == list(gpu_suite.CHUNK_LIMITS)
    assert replies[1]["chunks"] < replies[0]["chunks"] and all(r["rtf"] > 0 for r in replies)
    assert all(r["padded_flow_windows"] <= 1 for r in replies)
    assert [s["frames"] for s in limits["steps"]] == [17, 88, 144, 256, 384, 512, 640]
    assert all(s["flow_ms"] > 0 and s["vocoder_ms"] > 0 for s in limits["steps"])
    assert limits["steps"][-1]["vocoder_bucket"] == 640
    assert not data["not_measured"] and not data["failed"]
    # a CUDA stream needs CUDA: said, not failed
    assert data["needs_cuda"] == ["pipelined_reply with the synthesis stream", "synthesis_stream_calls",
                                  "call_streams_calls", "gpu_busy_calls", "compiled_flow_reply", "gpu_busy"]
    for key in ("pipelined", "pipelined_one_segment_ahead"):  # the agent's back-pressure, and the LM held closer
        pipelined = graphed[key]
        assert pipelined["audio_s"] > 1.0 and 0 < pipelined["first_audio_ms"] < 1000 * pipelined["wall_s"]
        assert pipelined["rtf"] == pytest.approx(pipelined["wall_s"] / pipelined["audio_s"])
    # the same reply, whatever the back-pressure
    assert graphed["pipelined"]["audio_s"] == graphed["pipelined_one_segment_ahead"]["audio_s"]
    text = out.read_text()
    assert ("| calls | eager median | graphed median | graphed max | synthesis stream median | synthesis stream max "
            "| call streams median | call streams max |") in text
    assert "| graphed, one stream |" in text and "| graphed, one stream, the LM one segment ahead |" in text
    assert "| graphed, one stream |" in text and "Not measured on this device (CUDA only): pipelined_reply" in text
    assert "| **first audio** |" in text and "| spoken LM, context 1024 |" in text
    assert "| speech decoder (every segment) |" in text and "| **whole reply** |" in text
    assert "| spoken LM ms per token, context 1024 | LoRA adapters on the side |" in text
    assert "| flow ODE ms (17 frames in bucket 17, unpadded) | three q/k/v products, ones mask |" in text
    assert "| flow ODE ms (87 frames in bucket 88, padded) | time conditioning in every estimator call |" in text
    assert "| graphed | 32/32 |" in text
    assert "| growing to 200 tokens |" in text and "| 640 |" in text
    assert "batched median" in text and "Batched speech-decoder steps over the whole table" in text
    assert "Batched synthesis over the whole table: flow " in text


def test_a_failing_part_is_reported_each_part_is_saved_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    """A lent GPU gives minutes: every part's figures are on disk as soon as it ends, a failing part
    does not cost the others, and parts past the budget are listed as not measured."""
    out = tmp_path / "gpu_suite.md"
    seen_before_first_audio = []

    def failing_parity(engine):
        raise RuntimeError("capture failed")

    original = gpu_suite.Suite.part_first_audio

    def first_audio_then_spend_the_budget(self, name):
        seen_before_first_audio.append(out.read_text())  # written after the parity part, before this one
        original(self, name)
        self.args.budget_s = 0.0

    monkeypatch.setattr(gpu_suite, "lm_parity", failing_parity)
    monkeypatch.setattr(gpu_suite.Suite, "part_first_audio", first_audio_then_spend_the_budget)
    rc = gpu_suite.main(["--device", "cpu", "--size", "tiny", "--quick", "--dtype", "float32", "--calls", "1",
                         "--parts", "eager_calls,per_token,first_audio,parity", "--budget-s", "3600", "--out", str(out)])
    assert rc == 1
    assert "**parity failed**: `RuntimeError: capture failed`" in seen_before_first_audio[0]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["failed"] == {"parity": "RuntimeError: capture failed"}
    assert data["not_measured"] == ["per_token", "eager_calls"]  # in the suite's order, whatever the flag's
    assert "first_audio" in data["paths"]["graphed"] and "lm_ms_per_token" not in data["paths"]["graphed"]
    text = out.read_text()
    assert "| **first audio** |" in text and "spoken LM, context" not in text and "Concurrent calls" not in text
    assert "Not measured in this run (its time budget was spent): per_token, eager_calls." in text


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        gpu_suite.main(["--parts", "first_audio,latency"])


def test_concurrent_calls_are_timed_from_the_moment_their_callers_stop_speaking():
    """A call's start (its session's warm-up) and the partial transcripts made while its caller
    spoke happen before ``turn_ends`` and are not timed; the ASR work left, and the rest, are."""
    import time

    from pipecat_taste.asr import TurnTranscript

    engine = gpu_suite.build_engine("tiny", "cpu", None)
    asr = gpu_suite.build_asr("tiny", engine, "cpu", None)
    graphed = gpu_suite.path_engine(engine, gpu_suite.GRAPHED)
    partials, at_turn_end = [], []
    partial = TurnTranscript.partial

    def counted(self, audio16k):
        partials.append(len(audio16k))
        return partial(self, audio16k)

    TurnTranscript.partial = counted
    try:
        with gpu_suite.ForcedReply(engine.model.spoken_lm) as forced:
            result = gpu_suite.first_audio(graphed, asr, gpu_suite.GRAPHED, forced, gpu_suite.user_audio(),
                                           turn_ends=lambda: (at_turn_end.append(len(partials)), time.sleep(2.0)))
    finally:
        TurnTranscript.partial = partial
    assert at_turn_end == [3] and len(partials) == 3  # 0.8, 1.6, 2.4 s of the 3 s turn, all before its end
    assert result["stages"]["asr_after_turn"] > 0
    assert result["first_audio_ms"] < 2000.0  # the two seconds spent in turn_ends is not in it


def test_the_compiled_flow_lever_times_both_steps_and_leaves_the_estimator_as_it_was():
    """The torch.compile lever traced whole (fullgraph: no graph break in the estimator) with the
    'eager' backend, so no C compiler is needed: the same mel as the plain step, timed both ways."""
    engine = gpu_suite.build_engine("tiny", "cpu", None)
    cfm = engine.voice_generator.flow.decoder
    plain = cfm.estimator
    result = gpu_suite.compiled_flow(engine, repeats=1, frames=(17,), backend="eager")
    assert cfm.estimator is plain
    (row,) = result["rows"]
    assert row["frames"] == 17 and row["plain_ms"] > 0 and row["compiled_ms"] > 0
    assert row["max_mel_diff"] < 1e-5 and row["compile_s"] > 0
    lines = gpu_suite.markdown({"device": "CPU", "size": "tiny", "dtype": "float32", "compiled_flow": result,
                                "paths": {"eager": {}, "graphed": {}}}, "cmd")
    assert any(line.startswith("| 17 |") for line in lines)


def test_the_flow_precision_lever_times_each_precision_against_float32_and_leaves_the_flow_as_it_was():
    """On a CPU: float32 and the bfloat16 and float16 copies of the ODE (TF32 is CUDA's), each timed, each
    mel against float32's - near it, not equal (the copies do compute in half precision) - and the
    engine's flow still float32, the same module."""
    engine = gpu_suite.build_engine("tiny", "cpu", None)
    cfm = engine.voice_generator.flow.decoder
    result = gpu_suite.flow_precision(engine, repeats=1, frames=(17, 24))
    assert engine.voice_generator.flow.decoder is cfm and cfm.estimator.final_proj.weight.dtype == torch.float32
    assert result["precisions"] == ["float32", "bfloat16", "float16"]
    assert [row["frames"] for row in result["rows"]] == [17, 24]
    for row in result["rows"]:
        assert all(row[p + "_ms"] > 0 for p in result["precisions"]) and row["float32_mel_diff"] == 0
        assert 0 < row["float16_mel_diff"] < row["bfloat16_mel_diff"] < 0.05 * row["mel_max"]
    lines = gpu_suite.markdown({"device": "CPU", "size": "tiny", "dtype": "float32", "flow_precision": result,
                                "paths": {"eager": {}, "graphed": {}}}, "cmd")
    assert [line.split(" | ")[0] for line in lines if line.startswith(("| 17 |", "| 24 |"))] == ["| 17", "| 24"]


def test_gpu_activity_is_the_union_of_the_device_events_inside_the_timed_span():
    """Busy time counts overlapping kernels (two streams side by side) once and clips them to the
    span; the summed durations count them each; events outside the span do not count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    assert gpu_suite.busy_us([]) == 0
    assert gpu_suite.busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25

    def event(name, device, start, end, annotation=False, thread=1):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation, thread=thread)

    events = [event(gpu_suite.TIMED_SPAN, DeviceType.CPU, 1000, 5000),
              event("before", DeviceType.CUDA, 0, 900),  # outside the span
              event("flow", DeviceType.CUDA, 900, 2000),  # clipped to 1000-2000
              event("decoder", DeviceType.CUDA, 1500, 2500),  # side by side with the flow 1500-2000
              event("vocoder", DeviceType.CUDA, 4000, 4500),
              event("aten::mm", DeviceType.CPU, 1000, 4000),  # a host operator: not the GPU's
              # the span's own range on the GPU's side (from its first to its last kernel): not work
              event(gpu_suite.TIMED_SPAN, DeviceType.CUDA, 1000, 4500, annotation=True)]
    activity = gpu_suite.gpu_activity(events)
    assert activity["span_ms"] == 4.0 and activity["device_events"] == 3
    assert activity["busy_ms"] == 2.0 and activity["kernel_ms"] == 2.5
    assert activity["busy_share"] == 0.5 and activity["side_by_side"] == 1.25
    # the host: thread 1's operator 1000-4000; its span range is not work
    assert activity["host_threads"] == 1 and activity["host_busy_share"] == 0.75
    # the GPU's time by kernel, clipped to the span: the flow 1000-2000, the decoder, the vocoder
    assert [(k["name"], k["count"], k["ms"]) for k in activity["device_kernels"]] == [
        ("flow", 1, 1.0), ("decoder", 1, 1.0), ("vocoder", 1, 0.5)]
    assert activity["host_side_by_side"] == 1.0
    with pytest.raises(ValueError, match="timed_span"):
        gpu_suite.gpu_activity(events[1:])
    # two threads taking turns (an interpreter lock): busy most of the span, never side by side
    turns = [event("aten::mm", DeviceType.CPU, 1000 + 500 * i, 1500 + 500 * i, thread=i % 2) for i in range(6)]
    activity = gpu_suite.gpu_activity(events[:1] + turns)
    assert activity["host_threads"] == 2 and activity["host_busy_share"] == 0.75
    assert activity["host_side_by_side"] == 1.0
    # and side by side: each thread's union counted apart, summed over the threads
    both = [event("aten::mm", DeviceType.CPU, 1000, 3000, thread=t) for t in (0, 1)]
    assert gpu_suite.gpu_activity(events[:1] + both)["host_side_by_side"] == 2.0
    # a wait for the GPU inside an operator is not host work (the interpreter lock is free meanwhile)
    waiting = [event("aten::_local_scalar_dense", DeviceType.CPU, 1000, 3000),
               event("cudaStreamSynchronize", DeviceType.CPU, 1200, 2800)]
    assert gpu_suite.gpu_activity(events[:1] + waiting)["host_busy_share"] == pytest.approx(0.1)
    # the host's time by operator: each one's own time (less what ran nested in it), clipped to the
    # span, summed over the threads, largest first
    nested = [event("aten::item", DeviceType.CPU, 500, 3000, thread=0),  # 1000-3000 in the span
              event("aten::_local_scalar_dense", DeviceType.CPU, 1100, 2900, thread=0),
              event("cudaStreamSynchronize", DeviceType.CPU, 1200, 2800, thread=0),
              event("aten::item", DeviceType.CPU, 3000, 3100, thread=0),  # after, not inside, the first
              event("cudaGraphLaunch", DeviceType.CPU, 1000, 1300, thread=1),
              event("cudaGraphLaunch", DeviceType.CPU, 4900, 5200, thread=1)]  # 4900-5000 in the span
    operators = gpu_suite.gpu_activity(events[:1] + nested)["host_operators"]
    assert [(o["name"], o["count"], o["own_ms"]) for o in operators] == [
        ("cudaStreamSynchronize", 1, 1.6), ("cudaGraphLaunch", 2, 0.4), ("aten::item", 2, 0.3),
        ("aten::_local_scalar_dense", 1, 0.2)]
    assert [o["name"] for o in gpu_suite.host_operators(nested, 1000, 5000, top=1)] == ["cudaStreamSynchronize"]
    assert gpu_suite.without([(0, 10), (5, 20)], [(2, 4), (18, 30)]) == [(0, 2), (4, 18)]
    assert gpu_suite.without([(0, 10)], []) == [(0, 10)] and gpu_suite.without([(0, 10)], [(0, 10)]) == []


def test_a_profiled_pipelined_reply_marks_its_timed_span_for_the_profiler():
    """The profiled reply runs (on a CPU there are no device events: nothing busy) and finds its span."""
    base = gpu_suite.build_engine("tiny", "cpu", None)
    asr = gpu_suite.build_asr("tiny", base, "cpu", None)
    engine = gpu_suite.path_engine(base, gpu_suite.GRAPHED)
    with gpu_suite.ForcedReply(base.model.spoken_lm) as forced:
        result = gpu_suite.profiled_pipelined_reply(engine, asr, gpu_suite.GRAPHED, forced, gpu_suite.user_audio())
    assert result["audio_s"] > 1.0 and result["rtf"] == pytest.approx(result["wall_s"] / result["audio_s"])
    assert result["span_ms"] >= 1000 * result["wall_s"] and result["device_events"] == 0 and result["busy_ms"] == 0


def test_profiled_calls_span_from_the_first_turn_end_to_the_last_first_audio():
    """Two calls ending at once under the profiler (on a CPU no device events): the span covers every
    call's timed part, and the host's threads are seen."""
    base = gpu_suite.build_engine("tiny", "cpu", None)
    asr = gpu_suite.build_asr("tiny", base, "cpu", None, calls=2)
    engine = gpu_suite.path_engine(base, gpu_suite.GRAPHED)
    with gpu_suite.ForcedReply(base.model.spoken_lm) as forced:
        result = gpu_suite.profiled_calls(engine, asr, gpu_suite.GRAPHED, forced, 2)
    assert result["calls"] == 2 and result["device_events"] == 0 and result["busy_share"] == 0
    assert result["unprofiled_first_audio_max_ms"] >= result["unprofiled_first_audio_median_ms"] > 0
    assert result["span_ms"] >= result["first_audio_max_ms"] * 0.9 > 0
    assert result["host_threads"] >= 2 and 0 < result["host_busy_share"] <= 1
    operators = result["host_operators"]
    assert 0 < len(operators) <= gpu_suite.HOST_OPERATORS
    assert all(o["count"] >= 1 and o["own_ms"] >= 0 for o in operators)
    assert [o["own_ms"] for o in operators] == sorted((o["own_ms"] for o in operators), reverse=True)
    assert sum(o["own_ms"] for o in operators) <= result["span_ms"] * result["host_threads"]
    lines = gpu_suite.markdown({"device": "CPU", "size": "tiny", "dtype": "float32", "paths": {"eager": {}, "graphed": {}},
                                "gpu_busy_calls": {"graphed": result}}, "cmd")
    assert any(line.startswith("| graphed | 2 |") for line in lines)
    assert any(line.startswith(f"| `{operators[0]['name']}` | {operators[0]['count']} |") for line in lines)
    assert result["device_kernels"] == []  # (a CPU: no kernels, and no table of them)
    assert not any(line.startswith("Where the GPU's time went") for line in lines)
    # every step's run was a named range of the calls' threads (on a CPU without kernels: no table)
    steps = {step["name"]: step for step in result["device_steps"]}
    assert steps["spoken LM step"]["runs"] >= 2 and steps["speech decoder step"]["runs"] >= 2
    assert all(step["ms"] == 0 for step in steps.values())
    assert not any(line.startswith("The GPU's time by captured step") for line in lines)
    kernels = [{"name": "void flash_fwd_kernel<" + "x" * 200, "count": 4, "ms": 2.0}]
    lines = gpu_suite.markdown({"device": "CPU", "size": "tiny", "dtype": "float32", "paths": {"eager": {}, "graphed": {}},
                                "gpu_busy_calls": {"graphed": {**result, "device_kernels": kernels}}}, "cmd")
    assert any(line.startswith("| `void flash_fwd_kernel<") and "| 4 | 2.0 | 0.500 |" in line for line in lines)


def test_the_gpu_time_by_step_sums_the_kernels_inside_each_step_s_marks_on_their_stream():
    """Each run of a step is a host range and, on the GPU's side, a mark per stream from its first
    to its last kernel (a graph replay's kernels are filed under no host event): a kernel counts for
    the step whose mark on its own stream holds its start, clipped to the span; runs are counted on
    the host; largest first, and tabled."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from taste_speech.step_graph import PROFILER_RANGE

    def event(name, device, start, end, stream=None, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation, thread=1,
                               device_resource_id=stream, time_range=SimpleNamespace(start=start, end=end))

    def run(name, start, *marks):  # the host's range and the GPU's marks: (stream, start, end)
        return [event(PROFILER_RANGE + name, DeviceType.CPU, start, start + 50, annotation=True)] + [
            event(PROFILER_RANGE + name, DeviceType.CUDA, a, b, stream, annotation=True) for stream, a, b in marks]

    def kernel(stream, start, end):
        return event("kernel", DeviceType.CUDA, start, end, stream)

    events = [*run("spoken LM step", 1000, (7, 1100, 1400)), *run("spoken LM step", 2000, (7, 2100, 2200)),
              *run("flow x1", 1500, (8, 1100, 3000)),  # on another stream, beside the LM's
              *run("flow x1", 500, (8, 600, 1050)),  # started before the span: no run counted, its kernels' end is
              *run("speech decoder step", 4000),  # launched nothing
              kernel(7, 1100, 1200), kernel(7, 1200, 1400), kernel(7, 2100, 2200),  # the LM's
              kernel(8, 1100, 2000), kernel(8, 2900, 3100),  # the flow's, the last one past its mark's end
              kernel(8, 700, 1050),  # in the early flow's mark, clipped to 1000-1050
              kernel(7, 1500, 1600), kernel(9, 1150, 1250)]  # outside any mark on its stream
    steps = gpu_suite.device_time_by_step(events, 1000, 5000)
    assert steps == [{"name": "flow x1", "runs": 1, "ms": 1.15}, {"name": "spoken LM step", "runs": 2, "ms": 0.4},
                     {"name": "speech decoder step", "runs": 1, "ms": 0.0}]
    row = {"calls": 2, "kernel_ms": 2.0, "device_steps": steps, "first_audio_median_ms": 1.0,
           "first_audio_max_ms": 1.0, "span_ms": 4.0, "busy_share": 0.5, "host_busy_share": 0.5,
           "host_side_by_side": 1.0, "host_threads": 2}
    lines = gpu_suite.markdown({"device": "CPU", "size": "tiny", "dtype": "float32", "paths": {"eager": {}, "graphed": {}},
                                "gpu_busy_calls": {"graphed": row}}, "cmd")
    assert any(f"all steps' {gpu_suite.fmt(1.15 + 0.4)} ms of the span's 2.0 summed kernel ms" in line for line in lines)
    assert "| spoken LM step | 2 | 0.4 | 0.200 |" in lines


def test_a_step_is_a_profiler_range_only_while_profiling(monkeypatch):
    from taste_speech.step_graph import PROFILER_RANGE, StepGraph

    step = StepGraph(lambda: torch.ones(2) * 2, "cpu", "rehearse", name="doubling")
    ranges = []
    record = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: ranges.append(name) or record(name))
    step.run()
    assert ranges == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(step.run(), torch.full((2,), 2.0))
    assert ranges == [PROFILER_RANGE + "doubling"]
    assert any(e.name == PROFILER_RANGE + "doubling" for e in prof.events())


def test_a_path_whose_engine_would_not_fit_the_budget_left_is_not_built():
    """A calls part whose engine is still to be warmed up (about a minute on a GPU) starts only
    with ENGINE_S left: else it is listed as not measured, and no engine is built for it."""
    import time
    from types import SimpleNamespace

    suite = gpu_suite.Suite.__new__(gpu_suite.Suite)
    suite.args = SimpleNamespace(budget_s=100.0, device="cpu", calls=(1, 2))
    suite.started, suite.engines = time.perf_counter() - (100.0 - gpu_suite.ENGINE_S / 2), {}
    suite.data = {"not_measured": [], "needs_cuda": [], "paths": {"graphed": {}}}
    suite.part_calls("batched_calls")
    assert suite.data["not_measured"] == ["batched_calls"] and suite.engines == {}
    suite.started = time.perf_counter()  # the whole budget left: it would be built (an engine already is)
    suite.engines[gpu_suite.BATCHED] = object()
    assert not suite._no_time_for_engine(gpu_suite.BATCHED, "batched_calls")
    del suite.engines[gpu_suite.BATCHED]
    assert not suite._no_time_for_engine(gpu_suite.BATCHED, "batched_calls")



def test_each_path_engine_is_warmed_up_for_the_most_calls_its_rows_run(monkeypatch):
    """As taste-agent --max-calls N does at start-up: on CUDA its rehearsal is N calls ending
    together, so the first row of N calls is not the first burst the engine sees."""
    from pipecat_taste.engine import TasteEngine

    warmed = []
    monkeypatch.setattr(TasteEngine, "warm_up", lambda self, calls=1, **kwargs: warmed.append(calls))
    base = gpu_suite.build_engine("tiny", "cpu", None)
    gpu_suite.path_engine(base, gpu_suite.GRAPHED, calls=8)
    gpu_suite.path_engine(base, gpu_suite.EAGER)
    assert warmed == [8, 1]


def test_the_pinned_host_blocks_each_row_made_are_tabled():
    graphed = {"concurrency_synthesis_stream": [{"calls": 1, "pinned_blocks_made": 0, "pinned_alloc_ms": 0.0},
                                                {"calls": 8, "pinned_blocks_made": 37, "pinned_alloc_ms": 200.8}],
               "concurrency_batched": [{"calls": 8}]}  # (a torch that does not count them)
    lines = gpu_suite.pinned_lines(graphed)
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].split("|")[1:-1] == [" calls ", " path ", " blocks made ", " ms making them "]
    assert [row.split("|")[1:-1] for row in table[2:]] == [[" 1 ", " synthesis stream ", " 0 ", " 0.0 "],
                                                           [" 8 ", " synthesis stream ", " 37 ", " 200.8 "]]
    assert gpu_suite.pinned_lines({"concurrency": [{"calls": 2}]}) == []
    assert gpu_suite.pinned_host_blocks() is None  # (no CUDA here)
