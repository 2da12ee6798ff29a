#!/usr/bin/env bash
# Regenerate the scripted caller's utterances (agents/taste_agents/caller_audio/*.wav) with espeak-ng:
# real synthetic speech, 16 kHz mono 16-bit, peak-normalised to -3 dBFS, with the transcripts in
# script.json. The committed WAVs are what tests and `taste-agent call --simulate` use, so runs are
# deterministic; this script documents (and can redo) how they were made.
# Needs: apt-get install -y espeak-ng sox
set -euo pipefail
cd "$(dirname "$0")/.."
out=agents/taste_agents/caller_audio
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say() {  # name voice text [words per minute]
  espeak-ng -v "$2" -s "${4:-165}" -w "$tmp/$1.wav" "$3"
  sox "$tmp/$1.wav" -r 16000 -c 1 -b 16 "$out/$1.wav" silence 1 0.02 0.5% reverse silence 1 0.02 0.5% reverse norm -3
}
say hello en-us "Hello, I would like to book a table for two tonight."
say time en-us "Around seven thirty, if that works."
say bargein en-us "Sorry, wait, can we make it eight instead?"
say goodbye en-us "Great, thank you. Goodbye."
say yes en-us "Yes." 240  # a clipped answer: the VAD hears about 0.2 s of it
cat > "$out/script.json" <<'JSON'
{
  "sample_rate": 16000,
  "utterances": {
    "hello": "Hello, I would like to book a table for two tonight.",
    "time": "Around seven thirty, if that works.",
    "bargein": "Sorry, wait, can we make it eight instead?",
    "goodbye": "Great, thank you. Goodbye.",
    "yes": "Yes."
  }
}
JSON
ls -l "$out"
