"""What a simulated call produced: the JSON report (measured on the recording), the stereo WAV
and the timeline plot.

Every figure that says what the caller experienced is measured on the line's recording (one
sample clock for both sides), not taken from the agent's own bookkeeping:

* first-audio latency: end of the caller's utterance -> first agent sample after it;
* reply duration: first to last agent sample of the reply;
* barge-in stop: barge-in detected (the agent's VAD) -> last agent sample of the cut-off reply, and
  the same from the onset of the caller's speech; the detection itself must come within
  ``BARGE_IN_DETECT_BOUND_MS`` of that onset;
* talk-over: time both sides are audible, outside the scripted barge-in windows.

``checks`` also verifies the audio path end to end: per reply, the audio the playout released is
the synthesizer's audio (bit-exact; after a barge-in a prefix of it plus a fade-out of what came
next), and the transport wrote exactly the released audio, in order, without overlaps.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np

ACTIVE_LEVEL = 100  # int16 peak above which a 10 ms frame counts as audible (about -50 dBFS)
# The agent hears a barge-in once the caller has spoken min_speech_secs (0.25 s, counted from the
# VAD's onset estimate) and the VAD has confirmed it (start_secs 0.2 s): about 0.35-0.45 s after the
# onset with the default capture. A detection later than this is a slow agent, whatever it then does.
BARGE_IN_DETECT_BOUND_MS = 700


def _pcm(chunks: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(chunks), dtype="<i2") if chunks else np.zeros(0, dtype="<i2")


def _active_frames(channel: np.ndarray, frame: int) -> np.ndarray:
    n = channel.size // frame
    return np.abs(channel[: n * frame].reshape(n, frame).astype(np.int32)).max(axis=1) > ACTIVE_LEVEL


def _intervals(mask: np.ndarray, frame: int) -> list[tuple[int, int]]:
    out, start = [], None
    for i, on in enumerate(mask):
        if on and start is None:
            start = i
        elif not on and start is not None:
            out.append((start * frame, i * frame))
            start = None
    if start is not None:
        out.append((start * frame, mask.size * frame))
    return out


def first_active(channel: np.ndarray, start: int, stop: int) -> int | None:
    idx = np.nonzero(np.abs(channel[start:stop].astype(np.int32)) > ACTIVE_LEVEL)[0]
    return None if idx.size == 0 else start + int(idx[0])


def last_active(channel: np.ndarray, start: int, stop: int) -> int | None:
    idx = np.nonzero(np.abs(channel[start:stop].astype(np.int32)) > ACTIVE_LEVEL)[0]
    return None if idx.size == 0 else start + int(idx[-1]) + 1


def _without_gap_bridges(released: np.ndarray, gaps) -> tuple[np.ndarray | None, list[int]]:
    """The released reply audio without the frames the playout sent into gaps (``record.audio_gaps``:
    each the heard audio's mirror faded to silence, no louder than the audio before it), and the
    reply samples at which the audio came back; (None, []) when a bridge is not what it should be."""
    kept, resumes, taken, last = [], [], 0, 0
    for before, n in gaps:
        start = before + taken
        bridge, heard = released[start:start + n].astype(np.int32), released[max(0, start - n):start].astype(np.int32)
        if bridge.size != n or bridge[-1] != 0 or (heard.size and np.abs(bridge).max() > np.abs(heard).max() + 1):
            return None, []
        kept.append(released[last:start])
        last, taken = start + n, taken + n
        resumes.append(before)
    kept.append(released[last:])
    return np.concatenate(kept), resumes


def reply_audio_intact(synth: np.ndarray, released: np.ndarray, record, chunk_samples: int,
                       fade_samples: int) -> tuple[bool, int]:
    """The rule for one reply: the audio the playout released is the synthesizer's audio, bit-exact -
    all of it, then only the zero padding of the last frame; or a prefix when the reply was cut
    (barge-in: followed by at most a fade-out of what came next, or of the heard audio mirrored when
    nothing more had come; hang-up: cut where the line went dead). Where the synthesizer fell
    behind, the playout's gap bridges are taken out and the audio after each may fade back in.
    Returns (intact, length of the identical prefix)."""
    released, resumes = _without_gap_bridges(released, getattr(record, "audio_gaps", None) or ())
    if released is None:
        return False, 0
    n = min(synth.size, released.size)
    same = synth[:n] == released[:n]
    for at in resumes:  # faded back in: no louder than the synthesized audio
        window = slice(at, min(at + fade_samples, n))
        same[window] |= np.abs(released[window].astype(np.int32)) <= np.abs(synth[window].astype(np.int32)) + 1
    common = int(np.argmin(np.append(same, False)))
    if record.ended_by_hangup and not record.interrupted:
        good = common == released.size or (common == synth.size and not released[synth.size:].any())
    elif record.interrupted and released.size <= synth.size + fade_samples:
        tail = released[common:]
        faded = synth[common:common + tail.size]
        if faded.size < tail.size:  # nothing more had arrived: the fade mirrors what was heard before it
            heard = np.concatenate([released[:common], faded])
            faded = np.concatenate([faded, heard[::-1][: tail.size - faded.size]])
        good = tail.size <= fade_samples and bool(np.all(np.abs(tail.astype(np.int32)) <= np.abs(faded.astype(np.int32)) + 1))
    else:
        good = common == synth.size and not released[synth.size:].any() and released.size - synth.size < chunk_samples
    return bool(good), common


def replies_with_audio(log) -> list[tuple[int, object]]:
    """(turn id, record) of every reply with audio synthesized or released, in order: a reply the
    playout never released is checked too (it was left out). Early replies taken back (their turn
    retracted) are dropped unheard by design."""
    turn_ids = sorted(set(log.synthesized_audio) | set(log.released_audio))
    return [(t, log.turns[t]) for t in turn_ids if t in log.turns]


def audio_path_checks(result, chunk_samples: int, fade_samples: int) -> dict:
    """Synthesized -> released -> written, per reply (see the module docstring)."""
    log, line = result.log, result.line
    per_turn, expected_writes, ok = [], [], True
    for turn_id, record in replies_with_audio(log):
        synth = _pcm(log.synthesized_audio.get(turn_id, []))
        released = _pcm(log.released_audio.get(turn_id, []))
        good, common = reply_audio_intact(synth, released, record, chunk_samples, fade_samples)
        padded = np.concatenate([released, np.zeros((-released.size) % chunk_samples, dtype="<i2")])
        expected_writes.append(padded)
        per_turn.append({"turn_id": turn_id, "synthesized_samples": int(synth.size), "released_samples": int(released.size),
                         "identical_prefix_samples": common, "interrupted": record.interrupted,
                         "ended_by_hangup": record.ended_by_hangup, "ok": good})
        ok &= good
    written = np.concatenate([w for _, w in line.writes]) if line.writes else np.zeros(0, dtype="<i2")
    expected = np.concatenate(expected_writes) if expected_writes else np.zeros(0, dtype="<i2")
    # At a hang-up the transport may still hold part of the last reply: what it wrote must then be
    # a prefix of what was released, short by no more than that reply.
    unwritten_ok = per_turn[-1]["released_samples"] + chunk_samples if per_turn and per_turn[-1]["ended_by_hangup"] else 0
    writes_equal = (written.size == expected.size or 0 < expected.size - written.size <= unwritten_ok) and \
        bool(np.array_equal(written, expected[: written.size]))
    no_overlap = all(line.writes[i][0] >= line.writes[i - 1][0] + line.writes[i - 1][1].size
                     for i in range(1, len(line.writes)))
    return {"per_reply": per_turn, "released_equals_synthesized": bool(ok), "written_equals_released": writes_equal,
            "writes_never_overlap": bool(no_overlap), "written_samples": int(written.size)}


CUT_LEVEL = 328  # 1% of full scale: the playout's fades reach 0, a cut stops on a sample past this


def line_cuts(writes: list[tuple[int, np.ndarray]], level: int = CUT_LEVEL) -> int:
    """Times the agent's audio stopped dead on the line and came back: a write that began after the
    previous one had played out (the line ran dry) with sound on either side of the gap. The
    playout's own gaps and a reply's ends are faded to silence; these are not - the event loop
    handed the next frame over too late (a loaded machine), and no fade of the playout's can cover
    that (it runs on the same loop). Each is a click."""
    cuts = 0
    for (before_at, before), (at, after) in zip(writes, writes[1:]):
        if at > before_at + before.size and before.size and after.size \
                and max(abs(int(before[-1])), abs(int(after[0]))) >= level:
            cuts += 1
    return cuts


def build_report(result, meta: dict) -> dict:
    line, caller, log = result.line, result.caller, result.log
    sr, frame = line.sample_rate, line.sample_rate // 100
    agent, caller_ch = line.agent, line.caller
    end_sample = max([line.play_sample, caller.clock] + [s for s, _ in []])
    agent = agent[:end_sample]
    texts = {e.name: e.text for e in caller.events if e.kind == "utterance_start"}
    barge_names = {e.name for e in caller.events if e.kind == "barge_in"}
    records = sorted(log.turns.values(), key=lambda r: r.turn_id)

    def sec(sample):
        return None if sample is None else round(sample / sr, 3)

    utterances = []
    bounds = [s for s, _, _ in caller.speech_intervals] + [end_sample]
    allowed_overlap: list[tuple[int, int]] = []
    # each turn's speech on the line's clock: (first sample, last sample or None)
    spans = {r.turn_id: (line.sample_of(r.speech_start), line.sample_of(r.speech_end))
             for r in records if r.speech_start is not None}
    for i, (start, stop, name) in enumerate(caller.speech_intervals):
        next_start = bounds[i + 1]
        # the agent's turns begun with this utterance, and one begun earlier that took it in (the
        # caller paused less than the VAD's stop_secs: two utterances, one turn)
        matched = [r for r in records if r.turn_id in spans and (
            start - 0.8 * sr <= spans[r.turn_id][0] <= stop
            or spans[r.turn_id][0] < start <= (spans[r.turn_id][1] if spans[r.turn_id][1] is not None else -1))]
        decided = [r for r in matched if r.decision is not None]
        # a turn that goes on into the next utterance is answered after that one, not this
        reply = next((r for r in reversed(decided) if r.decision == "reply"
                      and not (spans[r.turn_id][1] is not None and spans[r.turn_id][1] >= next_start)), None)
        entry = {
            "utterance": name, "text": texts.get(name, ""), "start_s": sec(start), "end_s": sec(stop),
            "barge_in": name in barge_names, "agent_turns": [r.turn_id for r in matched],
            "decision": decided[-1].decision if decided else None,
            "decisions": {r.turn_id: r.decision for r in matched},
        }
        asr = [r for r in decided if r.asr_after_end_ms is not None]
        if asr:  # the built-in ASR gave the transcript: its work after the end of the turn
            entry.update({"asr_after_end_ms": asr[-1].asr_after_end_ms, "asr_partials": asr[-1].asr_partials})
        # this reply's audio: from the moment its first sample was handed over (the audio just after
        # the utterance may still be an earlier reply's tail when the agent is behind)
        handed = None if reply is None or reply.first_audio_at is None else line.sample_of(reply.first_audio_at)
        first = None if handed is None else first_active(agent, max(stop, handed), next_start)  # never handed: none
        if reply is not None and first is not None:
            # to the caller's next words; a reply they cut into plays on over them until it stops -
            # up to the next reply's first sample (the barge-in figures below measure that stop)
            until = next_start
            if reply.interrupted:
                later = [line.sample_of(r.first_audio_at) for r in records if r.decision == "reply"
                         and r.first_audio_at is not None and r.first_audio_at > reply.first_audio_at]
                until = min(later, default=end_sample)
            last = last_active(agent, first, until)
            entry.update({
                "first_audio_latency_ms": round(1000 * (first - stop) / sr, 1),
                "agent_reported_latency_ms": None if reply.user_to_bot_s is None else round(1000 * reply.user_to_bot_s, 1),
                "reply_duration_ms": round(1000 * (last - first) / sr, 1),
                "reply_text": reply.reply_text, "played_text": reply.played_text,
                "interrupted": reply.interrupted, "underruns": reply.underruns,
                "start_hold_ms": round(1000 * reply.start_hold_s, 1),
                # handed on this long before the VAD confirmed the end of the turn (early reply)
                "early_by_ms": (None if reply.early_end_at is None or reply.vad_stop_at is None
                                else round(1000 * (reply.vad_stop_at - reply.early_end_at), 1)),
                "early_turns_retracted": reply.early_retracted,
            })
        elif reply is not None:
            entry.update({"first_audio_latency_ms": None, "reply_text": reply.reply_text, "interrupted": reply.interrupted})
        if name in barge_names:
            # (detected after the caller's words when they were short: a "yes" over the agent)
            window_end = max(stop, start + BARGE_IN_DETECT_BOUND_MS * sr // 1000)
            cut = next((r for r in records if r.interrupted and r.barge_in_at is not None
                        and start <= line.sample_of(r.barge_in_at) <= window_end), None)
            if cut is None:  # the agent never noticed: the check must not pass over it
                entry["barge_in_stop_ms"] = None
            else:
                detect = line.sample_of(cut.barge_in_at)
                # the cut reply's last sample, wherever it falls before the reply to the barge-in
                # (an agent that goes on talking after the caller stopped is not stopped)
                until = handed if handed is not None and handed > start else next_start
                last = last_active(agent, start, until) or start
                entry.update({
                    "cut_off_turn": cut.turn_id,
                    "barge_in_detected_s": sec(detect),
                    "barge_in_detected_after_onset_ms": round(1000 * (detect - start) / sr, 1),
                    "barge_in_stop_ms": round(1000 * max(0, last - detect) / sr, 1),
                    "barge_in_stop_from_speech_onset_ms": round(1000 * max(0, last - start) / sr, 1),
                    # the agent's own figure: barge-in detected -> last sample handed to its transport
                    "agent_side_barge_in_stop_ms": None if cut.barge_in_stop_s is None else round(1000 * cut.barge_in_stop_s, 1),
                    "cut_off_reply_played_text": cut.played_text, "cut_off_reply_text": cut.reply_text,
                    "cut_off_kept_words": cut.kept_words, "cut_off_total_words": cut.total_words,
                })
                allowed_overlap.append((start, max(last, detect)))
        utterances.append(entry)

    # Talk-over: both audible in the same 10 ms frame, outside the barge-in windows.
    n = min(agent.size, caller_ch.size) // frame
    agent_on = _active_frames(agent[: n * frame], frame)
    caller_on = np.zeros(n, dtype=bool)
    for start, stop, _ in caller.speech_intervals:
        caller_on[start // frame: -(-stop // frame)] = True
    both = agent_on & caller_on[:n]
    allowed = np.zeros(n, dtype=bool)
    for start, stop in allowed_overlap:
        allowed[start // frame: -(-stop // frame) + 1] = True
    talk_over_ms = 10.0 * float(np.sum(both & ~allowed))
    fade = log.fade_samples if log.fade_samples is not None else int(0.01 * sr)  # (the playout's fade_out_ms)
    path = audio_path_checks(result, line.frame_samples, fade) if getattr(line, "writes", None) is not None else {}
    every_decided = all(u["decision"] is not None for u in utterances) and all(r.decision is not None for r in records)
    stops = [u["barge_in_stop_ms"] for u in utterances if "barge_in_stop_ms" in u]
    latencies = [u["first_audio_latency_ms"] for u in utterances if u.get("first_audio_latency_ms") is not None]
    asr_after_end = [r.asr_after_end_ms for r in records if r.asr_after_end_ms is not None]
    log_dict = log.to_dict()
    report = {
        **meta,
        "call_id": meta.get("call_id"),
        "sample_rate": sr,
        "duration_s": round(result.duration_s, 2),
        "timed_out": result.timed_out,
        "turns": utterances,
        "summary": {
            "utterances": len(utterances),
            "agent_turns": len(records),
            "replies": sum(1 for r in records if r.decision == "reply"),
            "first_audio_latency_ms": {"per_turn": latencies,
                                       "median": float(np.median(latencies)) if latencies else None},
            "asr_after_end_ms": {"per_turn": asr_after_end,
                                 "median": float(np.median(asr_after_end)) if asr_after_end else None},
            "barge_in_stop_ms": stops,
            "underruns": sum(r.underruns for r in records),
            "line_cuts": line_cuts(line.writes or []),
            # a reply paused by a sound that proved to be no turn (a noise burst: the VAD heard speech,
            # the STT or ASR no words) goes on where it stopped (barge_in='pause'); with
            # barge_in='immediate' it was cut off: the caller hears it stop
            "replies_resumed_after_no_turn": sum(1 for r in records if getattr(r, "pauses_s", None)),
            "replies_cut_by_no_turn": sum(1 for r in records if r.interrupted and next(
                (later.decision for later in records if later.turn_id > r.turn_id), None) == "ignored"),
            "caller_heard_no_reply": sum(1 for e in caller.events if e.kind == "no_reply"),
            "early_replies": sum(1 for r in records if r.early_end_at is not None),
            "early_turns_retracted": len(log.retracted),
            "errors": len(result.errors),
        },
        "checks": {
            "every_turn_decided": every_decided,
            "talk_over_ms_outside_barge_in": talk_over_ms,
            "talk_over_ms_in_barge_in": 10.0 * float(np.sum(both & allowed)),
            # (None: the call had no barge-in to check)
            "barge_in_within_100ms": all(s is not None and s <= 100.0 for s in stops) if stops else None,
            # the 100 ms above count from the agent's own detection: it must come in time too
            f"barge_in_detected_within_{BARGE_IN_DETECT_BOUND_MS}ms": all(
                u.get("barge_in_detected_after_onset_ms") is not None
                and u["barge_in_detected_after_onset_ms"] <= BARGE_IN_DETECT_BOUND_MS
                for u in utterances if "barge_in_stop_ms" in u) if stops else None,
            **path,
        },
        "agent_turns": log_dict["turns"],
        "retracted_agent_turns": log_dict["retracted_turns"],  # handed on early, then taken back
        "metrics": result.metrics,
        "errors": result.errors,
        "caller_events": [{"t": sec(e.sample), "kind": e.kind, "name": e.name} for e in caller.events],
        "agent_speech_s": [(sec(a), sec(b)) for a, b in _intervals(agent_on, frame)],
    }
    return report


def write_wav(path: Path, stereo: np.ndarray, sample_rate: int) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(stereo.shape[1])
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(np.ascontiguousarray(stereo.astype("<i2")).tobytes())


def write_outputs(result, out_dir) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sr = result.line.sample_rate
    n = int(round(result.report["duration_s"] * sr))
    stereo = result.recording[:n]
    paths = {"recording": out / "recording.wav", "report": out / "report.json", "timeline": out / "timeline.png"}
    write_wav(paths["recording"], stereo, sr)
    paths["report"].write_text(json.dumps(result.report, indent=1, default=_json_default))
    plot_timeline(result.report, stereo, sr, paths["timeline"])
    return {k: str(v) for k, v in paths.items()}


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def plot_timeline(report: dict, stereo: np.ndarray, sample_rate: int, path: Path) -> None:
    """Who spoke when (waveform envelopes on two lanes), the agent's turns and decisions, latency
    arrows from the end of each utterance to the agent's first audio, early replies and barge-in
    markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hop = sample_rate // 100
    n = stereo.shape[0] // hop
    env = np.abs(stereo[: n * hop].astype(np.float32) / 32768.0).reshape(n, hop, 2).max(axis=1)
    t = np.arange(n) / 100.0
    fig, ax = plt.subplots(figsize=(max(10.0, t[-1] * 0.45 if n else 10.0), 4.2), dpi=110)
    lanes = {"caller": 1.0, "agent": 0.0}
    # (a call that never connected recorded nothing: empty lanes)
    caller, agent = (env[:, k] / max(env[:, k].max(initial=0.0), 1e-6) for k in (0, 1))
    ax.fill_between(t, lanes["caller"] - 0.4 * caller, lanes["caller"] + 0.4 * caller, color="tab:blue", lw=0)
    ax.fill_between(t, lanes["agent"] - 0.4 * agent, lanes["agent"] + 0.4 * agent, color="tab:orange", lw=0)
    for turn in report["turns"]:
        ax.text(turn["start_s"], 1.48, turn["utterance"], fontsize=8, color="tab:blue")
        label = turn.get("decision") or "no decision"
        ax.text(turn["end_s"], 0.62, label, fontsize=7, color="dimgray")
        latency = turn.get("first_audio_latency_ms")
        if latency is not None:
            x0, x1 = turn["end_s"], turn["end_s"] + latency / 1000.0
            ax.annotate("", xy=(x1, 0.5), xytext=(x0, 0.5), arrowprops=dict(arrowstyle="->", color="green", lw=1.2))
            ax.text((x0 + x1) / 2, 0.53, f"{latency:.0f} ms", fontsize=7, color="green", ha="center")
        if "barge_in_detected_s" in turn:
            x = turn["barge_in_detected_s"]
            ax.axvline(x, color="red", lw=1.0, ls="--")
            ax.text(x, -0.62, f"barge-in: stopped in {turn['barge_in_stop_ms']:.0f} ms", fontsize=7, color="red")
    for agent_turn in report["agent_turns"]:
        if agent_turn.get("speech_start") is not None and agent_turn.get("speech_end") is not None:
            ax.axvspan(agent_turn["speech_start"], agent_turn["speech_end"], ymin=0.78, ymax=0.8, color="tab:blue",
                       alpha=0.5)
    # Early replies: where a turn was handed on before the VAD's end, and where one was taken back.
    for agent_turns, marker, color in ((report["agent_turns"], "v", "purple"),
                                       (report.get("retracted_agent_turns", []), "x", "gray")):
        early = [a["early_end_at"] for a in agent_turns if a.get("early_end_at") is not None]
        ax.plot(early, [0.78] * len(early), marker, color=color, ms=5, ls="none")
    ax.plot([], [], "v", color="purple", label="answered early (before the VAD's end)")
    ax.plot([], [], "x", color="gray", label="early turn taken back (the caller went on)")
    ax.legend(loc="lower right", fontsize=7, frameon=False)
    ax.set_yticks([0, 1], ["agent", "caller"])
    ax.set_ylim(-0.8, 1.6)
    ax.set_xlabel("seconds")
    s = report.get("summary", {})
    ax.set_title(f"simulated call {report.get('call_id') or ''}: {s.get('replies', 0)} replies, "
                 f"median first-audio latency {s.get('first_audio_latency_ms', {}).get('median')} ms", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
