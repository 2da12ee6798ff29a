"""Conversation: the per-call state of the spoken LM.

It holds the system segment and the turns, and a KV cache of the rows of every committed turn, so a
new turn only appends its own rows (no re-prefill of history). The reply being generated appends
rows to the same cache; committing it (all of it, or only the words that were actually played
after a barge-in) crops the cache to what is kept and closes the turn. A rolling window drops the
oldest turns (never the system segment) when the history grows past ``max_tokens``/``max_turns``;
only then is the cache rebuilt. ``snapshot()``/``restore()`` copy the whole state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from taste_speech.modeling_spoken_lm import LMDecodeState
from taste_speech.streaming.prompt import CONTINUATION, PromptBuilder
from taste_speech.streaming.segment import TASTESegment


@dataclass
class ConversationSnapshot:
    system: TASTESegment | None
    turns: list[TASTESegment]
    state: LMDecodeState | None
    committed_rows: int
    turn_rows: list[int]


class Conversation:
    def __init__(self, model, processor, system: TASTESegment | None = None, prompt_format: str = CONTINUATION,
                 max_tokens: int = 2048, max_turns: int = 64):
        if system is not None and system.role != "system":
            raise ValueError("the system segment must have role 'system'")
        self.model = model
        self.builder = PromptBuilder(model.spoken_lm, model.rvq, processor.llm_tokenizer, prompt_format)
        self.system = system
        self.turns: list[TASTESegment] = []
        self.max_tokens, self.max_turns = max_tokens, max_turns
        self.state: LMDecodeState | None = None
        self.committed_rows = 0  # rows of committed segments in the cache
        self.turn_rows: list[int] = []  # rows each committed turn occupies

    @property
    def prompt_format(self) -> str:
        return self.builder.format

    @property
    def segments(self) -> list[TASTESegment]:
        return ([self.system] if self.system is not None else []) + list(self.turns)

    # -- cache management ---------------------------------------------------------------------
    @torch.no_grad()
    def _rebuild(self) -> None:
        lm = self.model.spoken_lm
        self.state = lm.new_decode_state()
        rows = [self.builder.sos_rows()]
        if self.system is not None:
            rows.append(self.builder.segment_rows(self.system))
        self.turn_rows = []
        for turn in self.turns:
            r = self.builder.segment_rows(turn)
            rows.append(r)
            self.turn_rows.append(r.shape[1])
        all_rows = torch.cat(rows, dim=1)
        lm.feed(self.state, all_rows)
        self.committed_rows = all_rows.shape[1]
        self.state.input_ids = [t for s in self.segments for t in s.text_ids[0].tolist()]

    def ensure_ready(self) -> LMDecodeState:
        if self.state is None:
            self._rebuild()
        return self.state

    def crop(self, rows: int) -> None:
        """Forget everything in the cache after the first ``rows`` rows."""
        extra = self.state.cache.get_seq_length() - rows
        if extra > 0:
            self.state.cache.crop(-extra)  # transformers' crop takes the number of rows to drop
        del self.state.rows[rows:]

    @torch.no_grad()
    def add_turn(self, segment: TASTESegment) -> None:
        """Append a committed turn (a user turn, or an assistant turn given from outside)."""
        state = self.ensure_ready()
        self.crop(self.committed_rows)  # drop any uncommitted reply rows
        rows = self.builder.segment_rows(segment)
        self.model.spoken_lm.feed(state, rows)
        self.turns.append(segment)
        self.turn_rows.append(rows.shape[1])
        self.committed_rows += rows.shape[1]
        state.input_ids.extend(segment.text_ids[0].tolist())
        self._apply_window()

    @torch.no_grad()
    def commit_reply(self, reply: TASTESegment, opening_rows: int, played_tokens: int | None = None) -> TASTESegment:
        """Keep the generated reply, or only its first ``played_tokens`` tokens (barge-in: the
        words that were actually played). The cache holds ``opening_rows`` + the reply's content
        rows after the committed rows; it is cropped to what is kept and the turn is closed."""
        if played_tokens is not None and played_tokens < reply.length:
            if played_tokens <= 0:
                self.crop(self.committed_rows)
                return None
            keep = reply.taste_ids[0, :played_tokens]
            reply = TASTESegment("assistant", "audio", reply.text_ids[:, :played_tokens], keep.unsqueeze(0))
        content_rows = reply.length
        self.crop(self.committed_rows + opening_rows + content_rows)
        closing = self.builder.reply_closing_rows(reply)
        if closing.shape[1]:
            self.model.spoken_lm.feed(self.state, closing)
        used = opening_rows + content_rows + closing.shape[1]
        self.turns.append(reply)
        self.turn_rows.append(used)
        self.committed_rows += used
        self.state.input_ids = [t for s in self.segments for t in s.text_ids[0].tolist()]
        self._apply_window()
        return reply

    def truncate_last_assistant(self, played_tokens: int) -> None:
        """After the fact: keep only the first ``played_tokens`` tokens of the last assistant turn."""
        for i in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[i]
            if turn.role == "assistant":
                if played_tokens <= 0:
                    del self.turns[i]
                else:
                    self.turns[i] = TASTESegment(turn.role, turn.modality, turn.text_ids[:, :played_tokens],
                                                 None if turn.taste_ids is None else turn.taste_ids[:, :played_tokens])
                self.state = None  # history changed in the middle: rebuild lazily
                return
        raise ValueError("there is no assistant turn to truncate")

    def _apply_window(self) -> None:
        dropped = False
        while self.turns and (len(self.turns) > self.max_turns or self.committed_rows > self.max_tokens):
            self.committed_rows -= self.turn_rows.pop(0)
            self.turns.pop(0)
            dropped = True
        if dropped:
            self.state = None  # positions shift: rebuild on next use

    # -- snapshots -------------------------------------------------------------------------------
    def snapshot(self) -> ConversationSnapshot:
        return ConversationSnapshot(self.system, list(self.turns), copy.deepcopy(self.state),
                                    self.committed_rows, list(self.turn_rows))

    def restore(self, snap: ConversationSnapshot) -> None:
        self.system, self.turns = snap.system, list(snap.turns)
        self.state = copy.deepcopy(snap.state)
        self.committed_rows, self.turn_rows = snap.committed_rows, list(snap.turn_rows)
