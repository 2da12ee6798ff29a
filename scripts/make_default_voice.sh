#!/usr/bin/env bash
# Regenerate taste_speech/default_voice.wav, the reference recording of the placeholder agent voice
# used when a checkpoint ships no default voice (the published one does not): synthetic speech from
# espeak-ng (a voice other than the scripted caller's), 16 kHz mono 16-bit, peak-normalised to -3 dBFS.
# The checkpoint's own speaker encoder turns it into the voice (TasteProcessor.default_speaker_embedding).
# Needs: apt-get install -y espeak-ng sox
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
espeak-ng -v en-us+Annie -s 160 -w "$tmp/raw.wav" \
  "Thanks for calling. I can help you with a booking, an order, or a question about your account. What can I do for you today?"
sox "$tmp/raw.wav" -r 16000 -c 1 -b 16 taste_speech/default_voice.wav \
  silence 1 0.02 0.5% reverse silence 1 0.02 0.5% reverse norm -3
ls -l taste_speech/default_voice.wav
