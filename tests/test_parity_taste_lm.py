"""Every parity point of the golden TasteForCausalLM set, through the same code path as
``python -m taste_speech.verify`` (each point is one assertion)."""

import subprocess
import sys

import pytest

from taste_speech.verify import Golden
from taste_speech.verify.__main__ import verify


@pytest.fixture(scope="module")
def results(taste_lm_tiny_a):
    return {r.name: r for r in verify(str(taste_lm_tiny_a))}


def test_every_golden_tensor_is_checked(results, taste_lm_tiny_a):
    golden = Golden(str(taste_lm_tiny_a))
    outputs = {k for k in golden.tensors if not k.startswith(("in.", "frontend."))}
    # diagnostics of the harness (decision gaps) and bookkeeping tensors are not model outputs
    skipped = {k for k in outputs if k.endswith(("top2_gap", "nn_distance_gap", "attention_mask",
                                                   "output_lengths", "text_labels", "speech_labels",
                                                   "lm_input_lengths", "audio_unit_lengths",
                                                   "d.labels", "ignore_eos", "speech_token_lengths"))}
    skipped |= {"h.speech_token_ids", "c.audio.generated_llm_token_lengths", "c.text.generated_llm_token_lengths"}
    checked = {name.split(" ")[0] for name in results}
    assert outputs - skipped - checked == set()


def test_all_points_match(results):
    failed = [r.line() for r in results.values() if not r.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("point", ["a.out.asr_indices", "a.out.llm_indices", "c.audio.generated_llm_indices",
                                   "c.text.generated_llm_token_ids", "d.gen.speech_token_ids"])
def test_discrete_points_are_exact(results, point):
    assert results[point].ok and results[point].tolerance == 0 and results[point].max_abs_diff == 0


@pytest.mark.parametrize("point", ["b.text_logits", "b.llm_last_hidden", "a.decoder.last_hidden", "d.logits",
                                   "c.audio.trace.text_logits_last_raw", "f.speech_logits"])
def test_float_points_within_1e4(results, point):
    assert results[point].max_abs_diff <= 1e-4


def test_verify_command_exit_codes(taste_lm_tiny_a, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "taste_speech.verify", str(taste_lm_tiny_a)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all parity points match" in ok.stdout
    # A corrupted golden output must make the command fail.
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "tiny_bad"
    shutil.copytree(taste_lm_tiny_a, bad)
    io = load_file(bad / "io.safetensors")
    io["b.text_logits"] = io["b.text_logits"] + 0.01
    save_file(io, bad / "io.safetensors")
    failed = subprocess.run([sys.executable, "-m", "taste_speech.verify", str(bad)], capture_output=True, text=True)
    assert failed.returncode != 0
    assert "FAIL b.text_logits" in failed.stdout
