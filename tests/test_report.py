"""The simulated call's report (taste_agents.report) on hand-made lines and records: its figures and
checks must fail when what they claim is false."""

from types import SimpleNamespace

import numpy as np

from pipecat_taste.call import CallLog, TurnRecord
from taste_agents.report import build_report

SR = 16000


class Line:
    """What the simulated phone line recorded: the agent's channel (loud where it spoke)."""

    def __init__(self, seconds: float, agent_speaks: list[tuple[float, float]]):
        n = int(seconds * SR)
        self.sample_rate, self.frame_samples, self.t0, self.play_sample, self.writes = SR, 320, 0.0, n, None
        self.agent, self.caller = np.zeros(n, np.int16), np.zeros(n, np.int16)
        for a, b in agent_speaks:
            self.agent[int(a * SR):int(b * SR)] = 3000

    def sample_of(self, t):
        return None if t is None else int(round((t - self.t0) * SR))


def report(line, utterances, records, barge_ins=(), log=None, no_reply_at=()):
    """``utterances``: (name, start s, end s); ``records``: TurnRecords of the agent; ``no_reply_at``:
    when the caller gave up waiting for a reply (s)."""
    events = [SimpleNamespace(sample=int(a * SR), kind="utterance_start", name=name, text="") for name, a, _ in utterances]
    events += [SimpleNamespace(sample=int(a * SR), kind="barge_in", name=name, text="")
               for name, a, _ in utterances if name in barge_ins]
    events += [SimpleNamespace(sample=int(t * SR), kind="no_reply", name="", text="") for t in no_reply_at]
    caller = SimpleNamespace(clock=line.agent.size, events=events,
                             speech_intervals=[(int(a * SR), int(b * SR), name) for name, a, b in utterances])
    log = log or CallLog()
    for record in records:
        log.turns[record.turn_id] = record
    result = SimpleNamespace(line=line, caller=caller, log=log, duration_s=line.agent.size / SR, timed_out=False,
                             metrics=[], errors=[])
    return build_report(result, {})


def test_a_reply_never_heard_has_no_latency():
    """The earlier reply still plays when the second one is decided; the second never reaches the
    line. Its 'first audio' was the earlier reply's tail (0 ms), and went into the median."""
    line = Line(8, [(1.5, 5.6)])
    out = report(line, [("u1", 0, 1), ("u2", 4.5, 5.0)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.5),
                  TurnRecord(2, speech_start=4.5, decision="reply", first_audio_at=None)])
    assert out["turns"][1]["first_audio_latency_ms"] is None
    assert out["summary"]["first_audio_latency_ms"]["per_turn"] == [500.0]


def test_an_agent_that_talks_on_after_the_barge_in_is_not_stopped():
    """Detected at 2.35 s, but the reply plays on to 5.5 s: the stop was measured only up to the end
    of the caller's words (2.4 s), so it read 50 ms."""
    line = Line(6, [(1.2, 5.5)])
    out = report(line, [("u1", 0, 1), ("wait", 2.0, 2.4)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                             barge_in_at=2.35),
                  TurnRecord(2, speech_start=2.0, decision="no_speech")], barge_ins={"wait"})
    assert out["summary"]["barge_in_stop_ms"] == [3150.0]
    assert not out["checks"]["barge_in_within_100ms"]


def test_a_barge_in_the_agent_never_noticed_fails_the_check():
    line = Line(10, [(1.2, 2.05), (4.2, 9.0)])
    out = report(line, [("u1", 0, 1), ("b1", 2.0, 2.6), ("u2", 3.0, 4.0), ("b2", 5.0, 5.6)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                             barge_in_at=2.0),
                  TurnRecord(2, speech_start=2.0, decision="no_speech"),
                  TurnRecord(3, speech_start=3.0, decision="reply", first_audio_at=4.2),
                  TurnRecord(4, speech_start=5.0, decision="no_speech")], barge_ins={"b1", "b2"})
    assert out["summary"]["barge_in_stop_ms"] == [50.0, None]
    assert not out["checks"]["barge_in_within_100ms"]


def test_a_barge_in_stopped_in_time_passes():
    """The control: the reply stops 50 ms after detection; the reply to the barge-in comes later."""
    line = Line(8, [(1.2, 2.05), (3.2, 4.0)])
    out = report(line, [("u1", 0, 1), ("b1", 2.0, 2.6)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                             barge_in_at=2.0),
                  TurnRecord(2, speech_start=2.0, decision="reply", first_audio_at=3.2)], barge_ins={"b1"})
    assert out["summary"]["barge_in_stop_ms"] == [50.0] and out["checks"]["barge_in_within_100ms"]
    assert out["checks"]["barge_in_detected_within_700ms"]
    assert out["turns"][1]["first_audio_latency_ms"] == 600.0
    # the cut reply played from 1.2 s until it stopped at 2.05 s, over the caller's first words
    assert out["turns"][0]["reply_duration_ms"] == 850.0 and out["turns"][1]["reply_duration_ms"] == 800.0


def test_a_barge_in_the_agent_noticed_late_fails_the_check():
    """The caller cuts in at 2.0 s (for 1.6 s); the agent notices only at 3.5 s and stops 50 ms later: the stop
    after its own detection is quick, the detection is not (it passed on the agent's word)."""
    line = Line(8, [(1.2, 3.55), (5.0, 6.0)])
    out = report(line, [("u1", 0, 1), ("b1", 2.0, 3.6)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                             barge_in_at=3.5),
                  TurnRecord(2, speech_start=2.0, decision="reply", first_audio_at=5.0)], barge_ins={"b1"})
    assert out["summary"]["barge_in_stop_ms"] == [50.0] and out["checks"]["barge_in_within_100ms"]
    assert out["turns"][1]["barge_in_detected_after_onset_ms"] == 1500.0
    assert not out["checks"]["barge_in_detected_within_700ms"]


def test_a_reply_synthesized_but_never_released_fails_the_audio_check():
    """The whole reply was synthesized and none of it reached the caller (held in the playout): the
    check looked only at replies with released audio, so it passed."""
    line = Line(4, [])
    line.writes = []
    log = CallLog(keep_audio=True)
    log.synthesized_audio[1] = [(np.ones(SR, "<i2") * 1000).tobytes()]
    out = report(line, [("u1", 0, 1)], [TurnRecord(1, speech_start=0.0, decision="reply")], log=log)
    assert out["checks"]["released_equals_synthesized"] is False
    assert out["checks"]["per_reply"][0]["released_samples"] == 0


def test_the_timeline_of_a_call_that_recorded_nothing_is_drawn(tmp_path):
    """A WebRTC caller that never connected leaves an empty recording: its report still gets a
    timeline (it was a traceback instead of the 'connection lost' report)."""
    from taste_agents.report import plot_timeline

    path = tmp_path / "timeline.png"
    plot_timeline({"turns": [], "agent_turns": [], "summary": {"replies": 0}}, np.zeros((0, 2), np.int16), SR, path)
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_a_short_barge_in_detected_after_its_words_is_still_the_barge_in():
    """A "yes" of 0.28 s over the agent is detected about 0.34 s after it began - after its end: it
    was reported as not detected (and its overlap as talk-over)."""
    line = Line(8, [(1.2, 2.4), (3.5, 4.5)])
    out = report(line, [("u1", 0, 1), ("yes", 2.0, 2.28)],
                 [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                             barge_in_at=2.34),
                  TurnRecord(2, speech_start=2.0, decision="reply", first_audio_at=3.5)], barge_ins={"yes"})
    assert out["turns"][1]["cut_off_turn"] == 1 and out["summary"]["barge_in_stop_ms"] == [60.0]
    assert out["checks"]["barge_in_within_100ms"] and out["checks"]["talk_over_ms_outside_barge_in"] == 0.0


def test_two_utterances_the_agent_heard_as_one_turn_are_both_decided():
    """The caller paused 0.3 s (less than the VAD's stop_secs): one turn, one reply after the second
    utterance. The second counted as undecided (the call failed its check) and the first as a reply
    without audio."""
    line = Line(8, [(3.0, 4.0)])
    out = report(line, [("hello", 0.0, 1.0), ("time", 1.3, 2.4)],
                 [TurnRecord(1, speech_start=0.0, speech_end=2.4, decision="reply", first_audio_at=3.0)])
    assert [t["decision"] for t in out["turns"]] == ["reply", "reply"] and out["checks"]["every_turn_decided"]
    assert "first_audio_latency_ms" not in out["turns"][0]  # answered after the second
    assert out["turns"][1]["first_audio_latency_ms"] == 600.0


def test_a_call_without_a_barge_in_has_no_barge_in_check_and_a_cut_by_a_noise_is_counted():
    line = Line(6, [(1.2, 2.0)])
    out = report(line, [("u1", 0, 1)], [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2)])
    assert out["checks"]["barge_in_within_100ms"] is None and out["checks"]["barge_in_detected_within_700ms"] is None
    assert out["summary"]["replies_cut_by_no_turn"] == 0
    noisy = report(Line(6, [(1.2, 2.0)]), [("u1", 0, 1)],
                   [TurnRecord(1, speech_start=0.0, decision="reply", first_audio_at=1.2, interrupted=True,
                               barge_in_at=2.0),
                    TurnRecord(2, speech_start=1.7, decision="ignored")], no_reply_at=[5.0])  # (a noise: no words)
    assert noisy["summary"]["replies_cut_by_no_turn"] == 1 and noisy["summary"]["caller_heard_no_reply"] == 1
    from taste_agents.cli import _summary

    said = _summary(noisy, {})
    assert "replies cut off by a sound that was no turn: 1" in said and "waited for a reply in vain: 1" in said
    assert "no barge-in to check" in _summary(out, {})


def test_audio_that_stops_dead_on_the_line_and_comes_back_is_counted_as_a_cut():
    """The line ran dry mid-sound (the event loop handed a frame over late): a click the playout's
    fades cannot cover, counted; writes back to back, a gap between faded ends (a reply's end, the
    playout's own bridge), or a quiet edge are no cut."""
    from taste_agents.report import line_cuts

    loud, faded = np.full(320, -1300, np.int16), np.linspace(-1300, 0, 320).astype(np.int16)
    rising = faded[::-1].copy()
    assert line_cuts([(0, loud), (320, loud), (640, faded)]) == 0  # back to back
    assert line_cuts([(0, loud), (320, faded), (1000, rising), (1320, loud)]) == 0  # faded out, faded in
    assert line_cuts([(0, loud), (400, loud)]) == 1  # stopped on -1300, came back on -1300
    assert line_cuts([(0, faded), (400, loud), (720, loud), (2000, rising)]) == 2  # a dead start, a dead stop
    assert line_cuts([]) == 0
