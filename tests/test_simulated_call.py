"""The main job: ``taste-agent call --simulate`` on the embedded tiny checkpoint.

One scripted call (greeting, follow-up, barge-in on the agent's answer, goodbye) runs once for
the module through the CLI's own code path; the tests check it on the recording and the call log:

* every user turn gets a decision;
* the agent never talks over the caller, except in the barge-in;
* the agent audio in the recording is exactly the synthesised audio (nothing lost or duplicated);
* after a barge-in the agent's audio stops within 100 ms;
* replies are begun before the VAD confirms the end of the turn and heard only after it.
"""

import json
import wave
from pathlib import Path

import numpy as np
import pytest

from taste_agents.caller import load_utterances
from taste_agents.cli import build_parser, simulated_call
from taste_agents.report import reply_audio_intact

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real-time calls, in process and over WebRTC

SR = 16000
AUDIBLE = 100  # int16 peak of an audible 10 ms frame (about -50 dBFS)


@pytest.fixture(scope="module")
def call(tmp_path_factory):
    out = tmp_path_factory.mktemp("call")
    args = build_parser().parse_args(["call", "--simulate", "--quiet", "--out", str(out / "call-{call_id}"),
                                      "--max-call-seconds", "240"])
    result = simulated_call(args)
    assert not result.timed_out
    return result


def pcm(chunks):
    return np.frombuffer(b"".join(chunks), dtype="<i2")


def audible_frames(channel):
    n = channel.size // 160
    return np.abs(channel[: n * 160].reshape(n, 160).astype(np.int32)).max(axis=1) > AUDIBLE


def test_outputs_are_written(call):
    paths = call.paths
    with wave.open(paths["recording"], "rb") as f:
        assert (f.getnchannels(), f.getframerate(), f.getsampwidth()) == (2, SR, 2)
        stereo = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, 2)
    assert stereo[:, 0].any() and stereo[:, 1].any()  # caller | agent
    report = json.loads(open(paths["report"]).read())
    assert report["call_id"] and len(report["turns"]) == 4
    assert Path(paths["report"]).parent.name == "call-" + report["call_id"][:8]  # the folder says which call
    with open(paths["timeline"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    turn = report["turns"][0]
    assert turn["first_audio_latency_ms"] > 0 and turn["reply_duration_ms"] > 0


def test_every_user_turn_gets_a_decision(call):
    records = list(call.log.turns.values())
    assert records and all(r.decision in ("reply", "no_speech") for r in records), [(r.turn_id, r.decision) for r in records]
    line = call.line
    for start, stop, name in call.caller.speech_intervals:
        mine = [r for r in records if start - 0.8 * SR <= line.sample_of(r.speech_start) <= stop]
        assert mine, f"utterance {name} got no agent turn"
    # The caller heard a reply to each utterance that was not cut short by its own barge-in.
    assert sum(r.decision == "reply" for r in records) >= 3


def test_agent_never_talks_over_the_caller_except_in_the_barge_in(call):
    line, caller = call.line, call.caller
    agent_on = audible_frames(line.agent)
    caller_on = np.zeros_like(agent_on)
    for start, stop, _ in caller.speech_intervals:
        caller_on[start // 160: -(-stop // 160)] = True
    overlap = np.nonzero(agent_on & caller_on)[0]
    barge = next(e for e in caller.events if e.kind == "barge_in")
    allowed_from, allowed_to = barge.sample // 160, (barge.sample + int(0.5 * SR)) // 160
    outside = [i for i in overlap if not allowed_from <= i <= allowed_to]
    assert not outside, f"agent audible over the caller at {[i / 100 for i in outside[:10]]} s"
    assert len(overlap) > 0  # the barge-in does overlap (the caller talked over the agent)


def test_agent_audio_in_the_recording_is_exactly_the_synthesised_audio(call):
    log, line = call.log, call.line
    # 1. the recording holds every write where it was played, and writes never overlap
    for (start, samples), nxt in zip(line.writes, line.writes[1:] + [(None, None)]):
        assert np.array_equal(line.agent[start:start + samples.size], samples)
        if nxt[0] is not None:
            assert nxt[0] >= start + samples.size
    written = np.concatenate([w for _, w in line.writes])
    # 2. what was written is what the playout released, reply after reply (plus the transport's
    #    zero padding of a reply's last partial frame)
    expected, interrupted = [], 0
    for turn_id in sorted(log.released_audio):
        released = pcm(log.released_audio[turn_id])
        synthesized = pcm(log.synthesized_audio[turn_id])
        expected.append(np.concatenate([released, np.zeros((-released.size) % line.frame_samples, "<i2")]))
        record = log.turns[turn_id]
        # all of it, bit-exact, then only zero padding; or, cut by the barge-in, a prefix and at most
        # 20 ms of fade-out made from what came next (gaps where the synthesis fell behind bridged)
        intact, _ = reply_audio_intact(synthesized, released, record, line.frame_samples, int(0.02 * SR))
        assert intact, (turn_id, record.audio_gaps)
        if record.interrupted:
            interrupted += 1
            assert record.dropped_samples == synthesized.size - record.played_samples
    assert np.array_equal(written, np.concatenate(expected))
    assert interrupted == 1
    # 3. and it is real audio: every reply produced some
    assert all(pcm(v).size > 0 for v in log.synthesized_audio.values())


def test_barge_in_stops_the_agent_within_100_ms(call):
    log, line = call.log, call.line
    cut = [r for r in log.turns.values() if r.interrupted]
    assert len(cut) == 1
    record = cut[0]
    detected = line.sample_of(record.barge_in_at)
    following = [r for r in log.turns.values() if r.first_audio_at is not None and r.first_audio_at > record.barge_in_at]
    next_reply = min(line.sample_of(r.first_audio_at) for r in following) if following else line.agent.size
    tail = np.nonzero(np.abs(line.agent[detected:next_reply].astype(int)) > 0)[0]
    last = detected + (int(tail[-1]) + 1 if tail.size else 0)
    stop_ms = 1000 * (last - detected) / SR
    assert stop_ms <= 100, f"agent audio went on for {stop_ms:.0f} ms after the barge-in was detected"
    # the conversation keeps only what was heard before the cut
    assert record.kept_words == record.played_words < record.total_words or record.total_words <= 1
    # the fade-out ends at silence: no click at the cut
    assert abs(int(line.agent[last - 1])) <= 400


def test_one_bot_started_stopped_pair_per_reply(call):
    from pipecat.frames.frames import BotStartedSpeakingFrame, BotStoppedSpeakingFrame

    kinds = [type(f) for _, f in call.frames if isinstance(f, (BotStartedSpeakingFrame, BotStoppedSpeakingFrame))]
    replies = sum(1 for r in call.log.turns.values() if r.first_audio_at is not None)
    assert kinds == [BotStartedSpeakingFrame, BotStoppedSpeakingFrame] * replies


def test_replies_begin_before_the_vads_end_and_are_heard_after_it(call):
    """Early replies are on in the main job: each reply was begun about stop_secs - early_reply_secs
    (300 ms) before the VAD confirmed the end of its turn, and no audio came before that."""
    report = json.loads(open(call.paths["report"]).read())
    replies = [t for t in report["turns"] if t.get("first_audio_latency_ms") is not None]
    assert replies and all(250 <= t["early_by_ms"] <= 400 for t in replies), [t["early_by_ms"] for t in replies]
    for record in call.log.turns.values():
        if record.first_audio_at is not None:
            assert record.early_end_at < record.vad_stop_at <= record.first_audio_at
    assert report["summary"]["early_replies"] == len(call.log.turns)
    assert len(report["retracted_agent_turns"]) == report["summary"]["early_turns_retracted"]


def test_an_utterance_knows_its_length_at_any_rate():
    from taste_agents.caller import load_utterances

    at_16k, at_8k = load_utterances()["hello"], load_utterances(sample_rate=8000)["hello"]
    assert at_8k.sample_rate == 8000 and abs(at_8k.seconds - at_16k.seconds) < 0.001  # (8 kHz read half as long)


def test_the_summary_says_which_reply_the_caller_cut_off(call):
    from taste_agents.cli import _summary

    rows = {line.split()[0]: line for line in _summary(call.report, call.paths).splitlines() if " decision=" in line}
    assert set(rows) == {"hello", "time", "bargein", "goodbye"}
    cut = {name for name, line in rows.items() if "(cut off)" in line}
    assert cut == {turn["utterance"] for turn in call.report["turns"] if turn.get("interrupted")} == {"time"}


def test_the_stt_s_interim_words_make_the_barge_in_and_its_words_are_every_turn_s_transcript(call):
    """The main job's STT sends interim words 0.8 s into each utterance, as a streaming STT does:
    the pause over the reply becomes the barge-in then, while the caller still speaks (not at the
    end of their turn), and from the first turn on the agent waits for the STT's words (no race
    with the built-in ASR, whose tiny random model would give random words)."""
    events = {e["kind"]: e for e in call.log.events}  # (the last of each kind)
    barge = next(e for e in call.caller.events if e.kind == "barge_in")
    said_until = next(end for start, end, name in call.caller.speech_intervals if start >= barge.sample)
    assert "reply_paused" in events and "barge_in" in events
    cut_at = call.line.sample_of(events["barge_in"]["t"] + call.log.t0)
    assert barge.sample < cut_at < said_until  # while the caller still spoke
    scripted = {u.text for u in load_utterances().values()}
    assert all(r.transcript in scripted for r in call.log.turns.values() if r.decision == "reply")
