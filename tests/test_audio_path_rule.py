"""The per-reply audio rule shared by the simulated-call report and the server load checks:
released audio == synthesized audio (all of it, or a cut prefix plus at most a fade-out)."""

from types import SimpleNamespace

import numpy as np

from taste_agents.report import reply_audio_intact

CHUNK, FADE = 320, 160


def record(interrupted=False, hangup=False):
    return SimpleNamespace(interrupted=interrupted, ended_by_hangup=hangup)


def speech(n=4000, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * 3000).astype("<i2")


def test_whole_reply_with_zero_padding_is_intact():
    synth = speech()
    released = np.concatenate([synth, np.zeros((-synth.size) % CHUNK, "<i2")])
    assert reply_audio_intact(synth, released, record(), CHUNK, FADE) == (True, synth.size)


def test_lost_or_duplicated_or_changed_audio_is_caught():
    synth = speech()
    lost = np.delete(synth, slice(1000, 1320))
    duplicated = np.concatenate([synth[:1320], synth[1000:]])
    changed = synth.copy()
    changed[2500] += 1
    for released in (lost, duplicated, changed, synth[:-1]):
        ok, common = reply_audio_intact(synth, released, record(), CHUNK, FADE)
        assert not ok and common < synth.size


def test_barge_in_keeps_a_prefix_and_a_fade_no_louder_than_the_audio():
    synth = speech()
    fade = (synth[2000:2000 + FADE] * np.linspace(1, 0, FADE)).astype("<i2")
    assert reply_audio_intact(synth, np.concatenate([synth[:2000], fade]), record(interrupted=True), CHUNK, FADE)[0]
    too_long = np.concatenate([synth[:2000], fade, fade])
    assert not reply_audio_intact(synth, too_long, record(interrupted=True), CHUNK, FADE)[0]
    louder = np.concatenate([synth[:2000], (fade.astype(np.int32) * 2).clip(-32768, 32767).astype("<i2")])
    assert not reply_audio_intact(synth, louder, record(interrupted=True), CHUNK, FADE)[0]


def test_hang_up_keeps_a_prefix_only():
    synth = speech()
    assert reply_audio_intact(synth, synth[:1500], record(hangup=True), CHUNK, FADE)[0]
    assert not reply_audio_intact(synth, np.concatenate([synth[:1500], speech(10, seed=1)]), record(hangup=True),
                                  CHUNK, FADE)[0]


def test_a_barge_in_after_all_audio_was_out_may_fade_the_heard_audio_mirrored():
    synth = speech()
    mirrored = (synth[::-1][:FADE] * np.linspace(1, 0, FADE)).astype("<i2")
    assert reply_audio_intact(synth, np.concatenate([synth, mirrored]), record(interrupted=True), CHUNK, FADE)[0]
    other = (speech(FADE, seed=2) * np.linspace(1, 0, FADE)).astype("<i2")
    assert not reply_audio_intact(synth, np.concatenate([synth, other]), record(interrupted=True), CHUNK, FADE)[0]


def test_a_gap_bridge_is_taken_out_and_the_audio_after_it_may_fade_back_in():
    """Where the synthesizer fell behind, the playout sends a frame of the heard audio mirrored and
    faded to silence into the gap, and fades the next audio in (``record.audio_gaps``)."""
    synth, n = speech(), 320
    bridge = np.zeros(n, "<i2")
    bridge[:FADE] = (synth[2000 - FADE:2000][::-1] * np.linspace(1, 0, FADE)).astype("<i2")
    back_in = synth[2000:].copy()
    back_in[:FADE] = (back_in[:FADE] * np.linspace(0, 1, FADE)).astype("<i2")
    gap = SimpleNamespace(interrupted=False, ended_by_hangup=False, audio_gaps=[(2000, n)])
    assert reply_audio_intact(synth, np.concatenate([synth[:2000], bridge, back_in]), gap, CHUNK, FADE) == (True, synth.size)
    wrong_place = SimpleNamespace(**{**vars(gap), "audio_gaps": [(1900, n)]})
    assert not reply_audio_intact(synth, np.concatenate([synth[:2000], bridge, back_in]), wrong_place, CHUNK, FADE)[0]
    loud = bridge.copy()
    loud[0] = 32000  # a bridge louder than the audio before it is no fade
    assert not reply_audio_intact(synth, np.concatenate([synth[:2000], loud, back_in]), gap, CHUNK, FADE)[0]
    changed = back_in.copy()
    changed[FADE + 10] += 1  # past the fade-in the audio is the synthesizer's, bit-exact
    assert not reply_audio_intact(synth, np.concatenate([synth[:2000], bridge, changed]), gap, CHUNK, FADE)[0]
