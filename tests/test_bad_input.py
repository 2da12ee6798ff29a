"""The bad-input matrix (issue 7, item 5): every kind of bad input a caller, an app or a user's
download can hand us, each with the clear error we promise - or, where the input is legal but
unusual (stereo, another rate, clipping, silence on the line), proof that it is handled.

All cases go through the real entry points on the embedded tiny checkpoint:
``TasteProcessor.prepare_audio`` / ``taste_tokenize`` (listen), ``TASTESegment`` /
``streaming_generate`` / ``taste_detokenize`` (think, speak), ``TasteForCausalLM.from_pretrained``
/ ``VoiceGenerator.from_pretrained`` / ``TasteEngine.from_pretrained`` (loading) and, for what
arrives over a call, the plugin's ``TasteTurnCapture`` with the real engine. Several cases are
also tested next to their code (test_processor, test_streaming_listen, test_checkpoint); this
file is the one place that lists them all.
"""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from taste_speech.loading import CheckpointError
from taste_speech.modeling_taste import TasteForCausalLM
from taste_speech.processing_taste import TasteProcessor
from taste_speech.streaming import TASTESegment, streaming_generate, taste_tokenize
from taste_speech.tiny import default_tiny_checkpoint
from taste_speech.voice_generator import VoiceGenerator

SR = 16000


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return Path(default_tiny_checkpoint())


@pytest.fixture(scope="module")
def model(checkpoint):
    return TasteForCausalLM.from_pretrained(str(checkpoint)).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return TasteProcessor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def hello():
    from taste_agents.caller import load_utterances

    return load_utterances()["hello"]


@pytest.fixture(scope="module")
def hello_ids(processor, hello):
    return processor.process_text(hello.text).llm_token_ids


@pytest.fixture(scope="module")
def hello_codes(model, processor, hello, hello_ids):
    return taste_tokenize(model, processor, torch.from_numpy(hello.audio).view(1, -1), hello_ids, sampling_rate=SR)


def _codes_are_valid(codes: torch.Tensor, ids: torch.Tensor, model) -> None:
    """(1, S, K) codes aligned to ids: every row a full code in range, or all -1."""
    k, size = model.rvq.num_quantizers, model.rvq.codebook_size
    assert codes.shape == (1, ids.shape[1], k) and codes.dtype == torch.long
    rows = codes[0]
    full = (rows >= 0).all(-1)
    assert bool(full[0]) and bool(((rows == -1).all(-1) | full).all())
    assert int(rows.max()) < size


# -- 1. sample rates ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0, -16000, 16000.5, None, "16k", True])
def test_wrong_sample_rate_is_named(processor, model, hello, hello_ids, rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        processor.prepare_audio(hello.audio, rate)
    with pytest.raises(ValueError, match="sampling_rate"):
        taste_tokenize(model, processor, hello.audio, hello_ids, sampling_rate=rate)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_sample_rates_are_resampled_not_refused(processor, model, hello, hello_ids, rate):
    from taste_speech.audio import resample

    audio = resample(hello.audio, SR, rate)
    wav = processor.prepare_audio(audio, rate)
    assert abs(wav.size - hello.audio.size) <= 2  # back at 16 kHz, same duration
    _codes_are_valid(taste_tokenize(model, processor, audio, hello_ids, sampling_rate=rate), hello_ids, model)


async def test_variable_sample_rate_within_a_call_is_resampled_per_frame(engine, hello):
    """Frames at 8, 16 and 48 kHz interleaved in one turn (a transport switching codecs): the
    capture resamples each to the pipeline rate and the turn is tokenized normally."""
    from pipecat_taste.audio import float_to_pcm16, resample

    rates = [8000, 16000, 48000]
    audio = np.concatenate([np.zeros(int(0.6 * SR), np.float32), hello.audio, np.zeros(int(1.0 * SR), np.float32)])
    frames, n = [], SR // 50
    for i, start in enumerate(range(0, audio.size - n + 1, n)):
        rate = rates[i % len(rates)]
        piece = resample(audio[start:start + n], SR, rate) if rate != SR else audio[start:start + n]
        frames.append((float_to_pcm16(piece), rate, 1))
    turns, call, errors = await _capture(engine, frames, hello.text)
    assert errors == []
    assert len(turns) == 1 and turns[0].turn.segment.role == "user"
    assert turns[0].turn.n_tokens == turns[0].turn.segment.length
    assert abs(turns[0].turn.audio_seconds - hello.seconds) < 0.8


# -- 2. channels -------------------------------------------------------------------------------------
def test_stereo_is_mixed_down(processor, model, hello, hello_ids, hello_codes):
    left, right = hello.audio, 0.5 * hello.audio
    mono = (left + right) / 2
    for stereo in (np.stack([left, right]), np.stack([left, right], axis=1)):  # (C, T) and (T, C)
        assert np.allclose(processor.prepare_audio(stereo, SR), processor.prepare_audio(mono, SR), atol=1e-6)
    # both channels carrying the same signal = the mono signal: the same codes, bit for bit
    same = np.stack([hello.audio, hello.audio])
    assert torch.equal(taste_tokenize(model, processor, same, hello_ids, sampling_rate=SR), hello_codes)


@pytest.mark.parametrize("shape, match", [((40, 40), "cannot tell channels"), ((2, 3, 16000), "1-D .* or 2-D")])
def test_ambiguous_or_higher_dimensional_audio_is_refused(processor, shape, match):
    with pytest.raises(ValueError, match=match):
        processor.prepare_audio(np.zeros(shape, np.float32) + 0.1, SR)


async def test_stereo_frames_in_a_call_are_mixed_down(engine, hello):
    from pipecat_taste.audio import float_to_pcm16

    audio = np.concatenate([np.zeros(int(0.6 * SR), np.float32), hello.audio, np.zeros(int(1.0 * SR), np.float32)])
    n = SR // 50
    frames = []
    for start in range(0, audio.size - n + 1, n):
        piece = audio[start:start + n]
        frames.append((float_to_pcm16(np.stack([piece, piece], axis=1).reshape(-1)), SR, 2))  # interleaved L R
    turns, _, errors = await _capture(engine, frames, hello.text)
    assert errors == [] and len(turns) == 1
    assert abs(turns[0].turn.audio_seconds - hello.seconds) < 0.8


# -- 3. empty, silence, NaN / inf ------------------------------------------------------------------------
@pytest.mark.parametrize("audio", [np.zeros(0, np.float32), torch.zeros(1, 0), []])
def test_empty_audio(processor, model, hello_ids, audio):
    with pytest.raises(ValueError, match="empty"):
        processor.prepare_audio(audio, SR)
    with pytest.raises(ValueError, match="empty"):
        taste_tokenize(model, processor, audio, hello_ids, sampling_rate=SR)


def test_empty_transcript(engine, processor, model, hello):
    session = engine.new_session()
    with pytest.raises(ValueError, match="transcript is empty"):
        session.user_turn(hello.audio, "   ")
    with pytest.raises(ValueError, match="text_ids is empty"):
        taste_tokenize(model, processor, hello.audio, torch.zeros(1, 0, dtype=torch.long), sampling_rate=SR)
    with pytest.raises(ValueError, match="no words"):
        processor.process_text("")


@pytest.mark.parametrize("audio", [np.zeros(SR, np.float32), np.full(SR, 1e-6, np.float32)])
def test_silence_only_turn_is_refused_by_the_tokenizer(model, processor, hello_ids, audio):
    with pytest.raises(ValueError, match="silent"):
        taste_tokenize(model, processor, audio, hello_ids, sampling_rate=SR)


async def test_silence_only_call_makes_no_turn_and_no_error(engine):
    from pipecat_taste.audio import float_to_pcm16

    n = SR // 50
    frames = [(float_to_pcm16(np.zeros(n, np.float32)), SR, 1) for _ in range(100)]  # 2 s of line silence
    turns, call, errors = await _capture(engine, frames, None)
    assert turns == [] and errors == [] and call.log.turns == {}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_samples(processor, model, hello, hello_ids, bad):
    audio = hello.audio.copy()
    audio[1234] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        processor.prepare_audio(audio, SR)
    with pytest.raises(ValueError, match="NaN or infinite"):
        taste_tokenize(model, processor, torch.from_numpy(audio), hello_ids, sampling_rate=SR)


# -- 4. too long, clipped ----------------------------------------------------------------------------------
def test_turn_longer_than_the_window(processor, model, hello, hello_ids):
    window = processor.max_seconds
    long = np.tile(hello.audio, int(window // hello.seconds) + 2)
    assert long.size / SR > window
    with pytest.raises(ValueError, match=rf"at most {window:g} s per turn: split the turn"):
        processor.prepare_audio(long, SR)
    with pytest.raises(ValueError, match="split the turn"):
        taste_tokenize(model, processor, long, hello_ids, sampling_rate=SR)
    # exactly the window is still accepted
    _codes_are_valid(taste_tokenize(model, processor, long[: int(window * SR)], hello_ids, sampling_rate=SR),
                     hello_ids, model)


async def test_a_call_splits_a_turn_longer_than_the_window(engine, hello):
    """On a call nobody can split the caller's audio beforehand: the capture closes the turn at the
    window and goes on in a new one; every piece is tokenized (no error, nothing refused)."""
    from pipecat_taste.audio import float_to_pcm16

    window = engine.max_turn_seconds
    speech = np.tile(hello.audio, int(window // hello.seconds) + 2)[: int((window + 3) * SR)]
    audio = np.concatenate([np.zeros(int(0.6 * SR), np.float32), speech, np.zeros(int(1.0 * SR), np.float32)])
    n = SR // 50
    frames = [(float_to_pcm16(audio[i:i + n]), SR, 1) for i in range(0, audio.size - n + 1, n)]
    turns, call, errors = await _capture(engine, frames, hello.text, transcripts=2)
    assert errors == []
    assert len(turns) >= 2
    assert all(t.turn.audio_seconds <= window for t in turns)


def test_clipped_audio_is_accepted(processor, model, hello, hello_ids):
    """Clipping (a hot microphone) is not an error: int16 audio saturated at full scale and float
    audio beyond [-1, 1] are tokenized like any other speech."""
    loud = hello.audio / max(1e-9, float(np.abs(hello.audio).max())) * 8.0
    clipped_int16 = np.clip(loud * 32768, -32768, 32767).astype(np.int16)
    assert np.mean(np.abs(clipped_int16) == 32767) > 0.05 or np.mean(clipped_int16 == -32768) > 0.05
    wav = processor.prepare_audio(clipped_int16, SR)
    assert np.isfinite(wav).all() and float(np.abs(wav).max()) <= 1.0
    _codes_are_valid(taste_tokenize(model, processor, clipped_int16, hello_ids, sampling_rate=SR), hello_ids, model)
    over = loud.astype(np.float32)  # float samples up to 8.0, not clipped at all
    _codes_are_valid(taste_tokenize(model, processor, over, hello_ids, sampling_rate=SR), hello_ids, model)


# -- 5. TASTESegment ------------------------------------------------------------------------------------
def _ids(n=3):
    return torch.arange(5, 5 + n).view(1, n)


def _codes(n=3, k=4):
    return torch.zeros(1, n, k, dtype=torch.long)


@pytest.mark.parametrize("kwargs, match", [
    (dict(role="bot", modality="audio", text_ids=_ids(), taste_ids=_codes()), "role must be one of"),
    (dict(role="user", modality="video", text_ids=_ids(), taste_ids=_codes()), "modality must be one of"),
    (dict(role="user", modality="text", text_ids=[5, 6, 7]), "must be a torch.Tensor"),
    (dict(role="user", modality="text", text_ids=torch.arange(3)), r"shape \(1, S\)"),
    (dict(role="user", modality="text", text_ids=torch.ones(1, 3)), "integer tensor"),
    (dict(role="user", modality="text", text_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
    (dict(role="user", modality="text", text_ids=-_ids()), "negative ids"),
    (dict(role="user", modality="text", text_ids=_ids(), taste_ids=_codes()), "must not carry taste_ids"),
    (dict(role="user", modality="audio", text_ids=_ids()), "needs taste_ids"),
    (dict(role="user", modality="audio", text_ids=_ids(), taste_ids=torch.zeros(3, 4, dtype=torch.long)),
     r"shape \(1, S, K\)"),
    (dict(role="user", modality="audio", text_ids=_ids(), taste_ids=torch.zeros(1, 3, 4)), "integer tensor"),
    (dict(role="user", modality="audio", text_ids=_ids(), taste_ids=_codes() - 2), "below -1"),
    (dict(role="user", modality="audio", text_ids=_ids(), taste_ids=_codes().to(torch.uint8)),
     "signed integer tensor"),  # (-1 cannot be one of its values)
    (dict(role="user", modality="audio", text_ids=_ids(),
          taste_ids=torch.tensor([[[1, 2, 3, 4], [5, -1, -1, -1], [-1, -1, -1, -1]]])), "mix codes and -1"),
    (dict(role="user", modality="audio", text_ids=_ids(), taste_ids=torch.full((1, 3, 4), -1)), "first token"),
])
def test_invalid_taste_segment(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TASTESegment(**kwargs)


def test_generation_refuses_what_is_not_a_segment(model, processor, hello_ids):
    with pytest.raises(ValueError, match="must be TASTESegment objects"):
        next(streaming_generate(model, processor, [{"text_ids": hello_ids}]))
    with pytest.raises(ValueError, match="no history"):
        next(streaming_generate(model, processor, []))


# -- 6. mismatched text / TASTE lengths -------------------------------------------------------------------
def test_mismatched_text_and_taste_lengths(model, processor, hello_ids, hello_codes):
    with pytest.raises(ValueError, match=rf"covers {hello_ids.shape[1] - 1} tokens but text_ids has {hello_ids.shape[1]}"):
        TASTESegment("user", "audio", hello_ids, hello_codes[:, :-1])
    with pytest.raises(ValueError, match="give one row per text token"):
        TASTESegment("user", "audio", hello_ids[:, :-1], hello_codes)


def test_detokenize_refuses_misaligned_codes(model, processor, hello_ids, hello_codes):
    from taste_speech.streaming import taste_detokenize

    vg = VoiceGenerator.from_pretrained(default_tiny_checkpoint())
    spk = processor.default_speaker_embedding().reshape(1, -1)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="rows but its text ids have"):
        taste_detokenize(model, processor, spk, empty, None, empty, 0.0, hello_ids, hello_codes[:, :-1],
                         voice_generator=vg)
    shifted = torch.roll(hello_codes, 1, dims=1)  # codes moved off the word starts
    with pytest.raises(ValueError, match="first token of every word"):
        taste_detokenize(model, processor, spk, empty, None, empty, 0.0, hello_ids, shifted, voice_generator=vg)
    with pytest.raises(ValueError, match="K=3 codes per row"):
        taste_detokenize(model, processor, spk, hello_ids, hello_codes[..., :3], empty, 0.0, hello_ids, hello_codes,
                         voice_generator=vg)


# -- 7. checkpoints: truncated, wrong, unsafe pickles ----------------------------------------------------------
def _copy(checkpoint: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(checkpoint, target)
    return target


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_truncated_model_file(checkpoint, tmp_path, keep):
    directory = _copy(checkpoint, tmp_path, "truncated")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors.*download it again"):
        TasteForCausalLM.from_pretrained(str(directory))
    from pipecat_taste.engine import TasteEngine

    with pytest.raises(CheckpointError, match="download it again"):  # the plugin reports the same error
        TasteEngine.from_pretrained(str(directory))


def test_truncated_voice_generator(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path, "truncated_vg")
    path = directory / "cosyvoice" / "voice_generator.pth"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated .*download it again"):
        VoiceGenerator.from_pretrained(str(directory))


def test_wrong_checkpoint_in_the_model_slot(checkpoint, tmp_path):
    """The voice generator's weights (another model) saved where the TASTE LM belongs: every
    missing and unexpected tensor is named, nothing is half-loaded."""
    directory = _copy(checkpoint, tmp_path, "wrong")
    other = torch.load(directory / "cosyvoice" / "voice_generator.pth", weights_only=True)
    save_file({k: v.contiguous() for k, v in other.items()}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        TasteForCausalLM.from_pretrained(str(directory))
    message = str(err.value)
    assert "missing tensor(s)" in message and "spoken_lm." in message
    assert "unexpected" in message and "flow." in message


def test_checkpoint_of_another_size(checkpoint, taste_lm_tiny_a, tmp_path):
    """Weights of one configuration with the config of another: the misshaped tensors are named
    with both shapes."""
    directory = _copy(checkpoint, tmp_path, "other_size")
    shutil.copy(taste_lm_tiny_a / "model.safetensors", directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"checkpoint \(\d+(, \d+)*\) != model \(\d+(, \d+)*\)"):
        TasteForCausalLM.from_pretrained(str(directory))


def test_wrong_voice_generator_weights(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path, "wrong_vg")
    lm = load_file(str(directory / "model.safetensors"))
    torch.save({k: v for k, v in list(lm.items())[:20]}, directory / "cosyvoice" / "voice_generator.pth")
    with pytest.raises(ValueError, match="does not match this VoiceGenerator .*missing"):
        VoiceGenerator.from_pretrained(str(directory))


class _Payload:
    """Unpickling this would create a file: the proof that no object from a file is executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_is_not_a_state_dict_for_the_model(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path, "pickled")
    state = load_file(str(directory / "model.safetensors"))
    os.remove(directory / "model.safetensors")
    marker = tmp_path / "executed"
    state["evil"] = _Payload(str(marker))
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a plain tensor state dict"):
        TasteForCausalLM.from_pretrained(str(directory))
    assert not marker.exists()


@pytest.mark.parametrize("content", ["payload", "module", "list", "nested"])
def test_pickle_that_is_not_a_state_dict_for_the_voice_generator(checkpoint, tmp_path, content):
    directory = _copy(checkpoint, tmp_path, "pickled_vg")
    path = directory / "cosyvoice" / "voice_generator.pth"
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "executed"
    obj = {
        "payload": {**state, "evil": _Payload(str(marker))},
        "module": torch.nn.Linear(2, 2),  # a whole pickled module, not its state dict
        "list": list(state.values()),
        "nested": {"state_dict": state, "epoch": 3},
    }[content]
    torch.save(obj, path)
    match = {"payload": "refuses to load safely", "module": "refuses to load safely", "list": "not a state dict",
             "nested": "not a flat name -> tensor state dict.*checkpoint\\['state_dict'\\]"}[content]
    with pytest.raises(ValueError, match=match):
        VoiceGenerator.from_pretrained(str(directory))
    assert not marker.exists()


def test_a_zip_that_is_not_a_torch_archive(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path, "zip")
    path = directory / "cosyvoice" / "voice_generator.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "not weights")
    with pytest.raises(ValueError, match="not a torch.save archive|truncated"):
        VoiceGenerator.from_pretrained(str(directory))
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))  # a plain pickle, not torch.save
    with pytest.raises(ValueError, match="refuses to load safely|not a flat name -> tensor"):
        VoiceGenerator.from_pretrained(str(plain))


# -- helpers: the plugin's capture with the real engine, driven without real time -------------------------
@pytest.fixture(scope="module")
def engine(checkpoint):
    from pipecat_taste.engine import TasteEngine

    return TasteEngine.from_pretrained(str(checkpoint))


async def _capture(engine, frames, text, transcripts: int = 1):
    """Run ``TasteTurnCapture`` (WebRTC VAD, real engine) over ``frames`` = (pcm, rate, channels);
    the transcript ``text`` arrives from 'upstream STT' after each detected end of speech.
    Returns (TasteUserTurnFrames, the call, ErrorFrame messages)."""
    from pipecat.frames.frames import ErrorFrame, InputAudioRawFrame, TranscriptionFrame
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.tests.utils import SleepFrame, run_test
    from pipecat.utils.time import time_now_iso8601

    from pipecat_taste import TasteCall, TasteTurnCapture, TurnCaptureParams, WebRTCVADAnalyzer
    from pipecat_taste.frames import TasteUserTurnFrame

    call = TasteCall(engine)
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                               params=TurnCaptureParams(transcript_timeout_secs=1.0))
    to_send = [InputAudioRawFrame(pcm, rate, channels) for pcm, rate, channels in frames]
    if text is not None:
        # the transcript of every piece lands while its turn is still being captured or just after
        every = max(1, len(to_send) // (transcripts + 1))
        out = []
        for i, frame in enumerate(to_send):
            out.append(frame)
            if i and i % every == 0 and transcripts > 1:
                out += [SleepFrame(0.05), TranscriptionFrame(text, "caller", time_now_iso8601(), finalized=True),
                        SleepFrame(0.1)]
        to_send = out + [SleepFrame(0.3), TranscriptionFrame(text, "caller", time_now_iso8601(), finalized=True)]
    down, up = await run_test(capture, frames_to_send=to_send + [SleepFrame(2.0)],
                              pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    turns = [f for f in down if isinstance(f, TasteUserTurnFrame)]
    errors = [f.error for f in up if isinstance(f, ErrorFrame)] + [f.error for f in down if isinstance(f, ErrorFrame)]
    return turns, call, errors


# -- arguments refused where they are given (not deep in torch, mid-call, or as a wrong voice) -----------
def test_a_soundfile_pair_is_named(model, processor, hello, hello_ids):
    pair = (hello.audio, SR)  # what soundfile.read returns
    with pytest.raises(ValueError, match=r"\(samples, rate\) pair.*data, rate = soundfile.read"):
        taste_tokenize(model, processor, pair, hello_ids, sampling_rate=SR)
    with pytest.raises(ValueError, match=r"\(samples, rate\) pair"):
        processor.speaker_embedding(pair, SR)


def test_a_transcript_of_punctuation_only_is_refused(model, processor, engine, hello):
    """Whisper writes "." for a noise: aligning the audio to it would answer the noise."""
    ids = processor.process_text(" ... !!").llm_token_ids
    with pytest.raises(ValueError, match="no spoken words .only punctuation."):
        taste_tokenize(model, processor, hello.audio, ids, sampling_rate=SR)
    with pytest.raises(ValueError, match="only punctuation"):
        engine.new_session().user_turn(hello.audio, ".")
    accented = processor.process_text(" café, ¿sí?").llm_token_ids  # letters of any script are words
    assert taste_tokenize(model, processor, hello.audio, accented, sampling_rate=SR).shape[1] == accented.shape[1]


def test_a_stereo_turn_is_mixed_down_by_the_session(engine, hello):
    session = engine.new_session()
    mono = session.user_turn(hello.audio, hello.text)
    stereo = session.user_turn(np.stack([hello.audio, hello.audio]), hello.text)  # was read as one long channel
    assert stereo.audio_seconds == pytest.approx(mono.audio_seconds)
    assert torch.equal(stereo.segment.taste_ids, mono.segment.taste_ids)


def test_reference_audio_for_a_voice(processor, hello, caplog):
    as_list = processor.speaker_embedding(hello.audio.tolist(), SR)  # a list of samples is one clip
    assert torch.allclose(as_list, processor.speaker_embedding(hello.audio, SR))
    with pytest.raises(ValueError, match=r"the reference clip is 0.30 s long.*at least 0.5 s"):
        processor.speaker_embedding(hello.audio[: int(0.3 * SR)], SR)
    with pytest.raises(ValueError, match=r"the reference clip is 0.01 s long.*at least 0.5 s"):  # under the fbank's window
        processor.speaker_embedding(hello.audio[: int(0.01 * SR)], SR)
    with caplog.at_level("WARNING", logger="taste_speech.processing_taste"):
        processor.speaker_embedding(hello.audio[:SR], SR)
    assert "only 1.0 s long" in caplog.text


def test_a_voice_must_be_a_speaker_embedding(engine, model, processor, hello, hello_ids, hello_codes):
    with pytest.raises(ValueError, match=r"sample_rate in Hz"):
        engine.speaker_embedding(hello.audio)  # was taken as 16 kHz whatever its rate
    with pytest.raises(ValueError, match=r"voice must be a \(1, 192\) speaker embedding, got shape \(\d+,\)"):
        engine.new_session(voice=hello.audio)  # audio, not its x-vector
    with pytest.raises(ValueError, match="voice is all zeros"):
        engine.new_session(voice=np.zeros(192, np.float32))
    flat = processor.default_speaker_embedding().reshape(-1).numpy()
    assert engine.new_session(voice=flat).voice.shape == (1, 192)
    from taste_speech.streaming import taste_detokenize

    vg, empty = VoiceGenerator.from_pretrained(default_tiny_checkpoint()), torch.zeros(1, 0, dtype=torch.long)
    for speaker, match in ((None, "speaker_embeds is required"), (torch.zeros(1, 192), "all zeros"),
                           ("default", "must be a .1, 192. tensor, got str")):
        with pytest.raises(ValueError, match=match):
            taste_detokenize(model, processor, speaker, empty, None, empty, 0.0, hello_ids, hello_codes,
                             voice_generator=vg)


def test_a_generator_must_be_a_torch_generator(model, processor, hello_ids, hello_codes):
    from taste_speech.streaming import taste_detokenize

    turn = TASTESegment("user", "audio", hello_ids, hello_codes)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator .*got int"):
        streaming_generate(model, processor, [turn], generator=0)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator"):
        empty = torch.zeros(1, 0, dtype=torch.long)
        taste_detokenize(model, processor, processor.default_speaker_embedding(), empty, None, empty, 0.0, hello_ids,
                         hello_codes, voice_generator=VoiceGenerator.from_pretrained(default_tiny_checkpoint()),
                         generator=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(extra_words=2.7), "extra_words must be a whole number"),
    (dict(extra_words=None), "extra_words must be a finite number"),
    (dict(text_top_p="0.3"), "text_top_p must be a finite number, got '0.3'"),
])
def test_sampling_arguments(model, processor, hello_ids, hello_codes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        streaming_generate(model, processor, [TASTESegment("user", "audio", hello_ids, hello_codes)], **kwargs)


def test_a_conversation_takes_the_model_then_the_processor(model, processor):
    from taste_speech.streaming import Conversation

    with pytest.raises(ValueError, match="takes a TasteForCausalLM and a TasteProcessor, got TasteProcessor"):
        Conversation(processor, model)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_reply_tokens=0), r"max_reply_tokens must be an integer >= 1, got 0"),
    (dict(words_per_segment=1.5), r"words_per_segment must be an integer >= 1"),
    (dict(history_max_turns=-1), r"history_max_turns must be an integer >= 1"),
    (dict(seed=1.5), r"seed must be an integer"),
    (dict(seed=2 ** 64 - 2), r"seed must be in \[-2\*\*63, 2\*\*64 - 3\]"),  # seed + 2 would overflow
    (dict(seed=-2 ** 63 - 1), r"seed must be in"),
    (dict(prompt_format="chat"), r"prompt_format must be one of"),
    (dict(text_temperature=0), r"GenerationSettings: text_temperature must be > 0"),
    (dict(text_top_p=2), r"GenerationSettings: text_top_p must be in \[0, 1\]"),
    (dict(system_prompt=["be brief"]), r"system_prompt must be a string"),
    (dict(system_prompt="  "), r"system_prompt has no words: give one, or None"),
])
def test_generation_settings_are_checked_when_made(kwargs, match):
    from pipecat_taste.session import GenerationSettings

    with pytest.raises(ValueError, match=match):
        GenerationSettings(**kwargs)


def test_the_extreme_seeds_make_a_session(engine):
    """The ends of the range seed the session's three generators (seed, seed + 1, seed + 2) as
    given: the same seed draws the same, the two ends draw differently."""
    import torch

    from pipecat_taste.session import GenerationSettings

    def draws(seed):
        session = engine.new_session(GenerationSettings(seed=seed))
        try:
            return [torch.rand(4, generator=g).tolist() for g in
                    (session._lm_generator, session._speech_generator, session._synthesis_generator)]
        finally:
            session.close()

    low, high = draws(-2 ** 63), draws(2 ** 64 - 3)
    assert draws(-2 ** 63) == low and draws(2 ** 64 - 3) == high
    assert all(a != b for a, b in zip(low, high)) and len({str(d) for d in high}) == 3


def test_engine_options_are_checked_before_anything_loads(engine):
    from pipecat_taste.engine import TasteEngine

    missing = "/no/such/checkpoint"  # the option is refused before the (missing) weights are looked for
    for kwargs, match in ((dict(asr=True), "asr must be 'auto', a Whisper folder or hub id"),
                          (dict(decoding="fast"), "decoding must be one of"),
                          (dict(batch_slots=0), "batch_slots must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            TasteEngine.from_pretrained(missing, **kwargs)
    with pytest.raises(FileNotFoundError, match="no Whisper model at '/no/such/whisper': it is neither a folder nor"):
        TasteEngine.from_pretrained(missing, asr="/no/such/whisper")  # refused before the checkpoint is looked at
    with pytest.raises(FileNotFoundError, match=r"no Whisper model at 'none'.*pass asr=None"):  # (the CLI's spelling)
        TasteEngine.from_pretrained(missing, asr="none")
    with pytest.raises(ValueError, match="settings must be a GenerationSettings, got dict"):
        engine.new_session(settings={"max_reply_tokens": 32})


@pytest.mark.parametrize("device", ["gpu", "CPU", -1, True])
def test_a_device_name_that_torch_does_not_know(device):
    from taste_speech.modeling_taste import resolve_device

    with pytest.raises(ValueError, match=r"is not a torch device: use 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        resolve_device(device)


def test_a_device_number_is_that_cuda_gpu():
    from taste_speech.modeling_taste import resolve_device

    if torch.cuda.is_available():
        assert resolve_device(0) == torch.device("cuda:0")
    else:
        with pytest.raises(RuntimeError, match=r"device='cuda:0' was requested but CUDA is not available"):
            resolve_device(0)


def test_no_checkpoint_named():
    for load in (TasteForCausalLM.from_pretrained, TasteProcessor.from_pretrained):
        with pytest.raises(ValueError, match=r"pass a checkpoint folder or hub id .owner/name., got None"):
            load(None)
    with pytest.raises(ValueError, match="pass the checkpoint folder .or the voice generator's weight file., got None"):
        VoiceGenerator.from_pretrained(None)
    with pytest.raises(ValueError, match="do not exist: pass a local checkpoint folder holding cosyvoice/voice_generator.pth"):
        VoiceGenerator.from_pretrained("MediaTek-Research/Llama-1B-TASTE-V0")  # local weights only


@pytest.mark.parametrize("name, value", [("pre_roll_secs", float("nan")), ("min_speech_secs", "0.25"),
                                         ("early_reply_secs", float("inf")), ("transcript_timeout_secs", None)])
def test_capture_params_must_be_finite_seconds(name, value):
    from pipecat_taste.capture import TurnCaptureParams

    with pytest.raises(ValueError, match=rf"TurnCaptureParams.{name} must be a finite number of seconds"):
        TurnCaptureParams(**{name: value})


async def test_an_output_rate_the_synthesis_cannot_make_is_refused_when_the_pipeline_starts():
    """(It was taken as given, and every reply then failed on its own, silent.)"""
    from pipecat.frames.frames import ErrorFrame
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine

    _, up = await run_test(TasteSynthesizer(TasteCall(FakeEngine())), frames_to_send=[SleepFrame(0.1)],
                           pipeline_params=PipelineParams(audio_out_sample_rate=11025))
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert any("audio_out_sample_rate is 11025 Hz" in e and "set PipelineParams(audio_out_sample_rate=...)" in e
               for e in errors), errors
