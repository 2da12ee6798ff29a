"""Conversation: the per-call state of the spoken LM.

A conversation holds the system segment, the committed turns and a KV cache of exactly their
rows (in one prompt format, see ``prompt.py``). A new turn only appends its own rows - the history
is never prefilled again. A reply being generated appends rows to the same cache and is committed
when it ends; ``truncate_last_assistant`` cuts it to the words that were actually played after a
barge-in (the cache is cropped in place), and ``forget_from`` takes back a user turn that was
answered too early (with its reply). A rolling window (``max_tokens`` / ``max_turns``) drops
the oldest exchanges (a user turn with the replies to it), never the system segment and never the
newest exchange; only then is the cache prefilled again, because every later row's position
changes. It drops down to ``WINDOW_LOW_WATER`` of the limits, so that a long call prefills its
history every few exchanges rather than at every turn. A reply that takes the history past a
limit leaves the move due (``window_due``); it is made between turns - ``move_window()``, or
``streaming_generate``'s iterator run to its end - and otherwise before the next turn or reply
is fed, so that the prefill does not hold up the reply's last words. All of it lives in one
``ConversationState`` that ``snapshot()`` copies and ``restore()`` puts back.

With ``lm_batch`` (an ``LMStepBatch`` shared by the conversations of one model) the cache is a
slot of that batch: every decode step runs batched with the other conversations' steps. Such a
conversation holds its slot until ``close()`` (``with Conversation(...) as conversation:`` closes
it), or until it is garbage collected.

A conversation serves one reply at a time: while a ``streaming_generate`` iterator on it is open
(or running in another thread), every other use of it - another ``streaming_generate``, a turn
added, ``truncate_last_assistant``, ``forget_from``, a snapshot, ``close()`` - raises instead of
changing the cache under the reply. Finish or close the iterator first.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
import threading
from dataclasses import dataclass, field

import torch

from taste_speech.lm_cache import CACHE_KINDS, StaticLMCache
from taste_speech.modeling_spoken_lm import LMDecodeState
from taste_speech.streaming.prompt import CONTINUATION, PromptFormat
from taste_speech.streaming.segment import TASTESegment
from taste_speech.streaming.tokenize import check_no_special_ids


REPLY_ROWS = 512  # room a static cache keeps beyond the window for the reply in progress
WINDOW_LOW_WATER = 0.75  # past a limit, the window drops old exchanges down to this share of it
REPLY_IN_PROGRESS = ("a reply is being generated on this conversation (another streaming_generate iterator is open "
                     "or running in another thread): finish or close it first")


@dataclass
class ConversationState:
    """Everything a conversation remembers (snapshot / restore copy this object)."""

    system: TASTESegment | None = None
    turns: list[TASTESegment] = field(default_factory=list)
    turn_rows: list[int] = field(default_factory=list)  # cache rows of each committed turn
    turn_ids: list[int] = field(default_factory=list)  # penalty ids each committed turn added
    turn_carry: list = field(default_factory=list)  # carry before each turn (continuation format)
    decode: LMDecodeState | None = None  # the KV cache; None = rebuild on next use
    committed_rows: int = 0  # rows of everything committed (a reply in progress lies beyond)
    committed_ids: int = 0  # length of decode.input_ids that belongs to committed rows
    committed_hidden: torch.Tensor | None = None  # hidden state of the last committed row (1, H)
    carry: torch.Tensor | None = None  # continuation format: code the next stream row inherits
    reply_opening: int = 0  # rows the reply in progress fed before its content
    # What the cache rows were made with (the model's: set when they are made; the format: by
    # snapshot(); restore() checks both, and a live conversation makes its rows again when the
    # model was cast or moved since).
    prompt_format: str | None = None
    model_identity: tuple | None = None

    @property
    def segments(self) -> list[TASTESegment]:
        return ([self.system] if self.system is not None else []) + list(self.turns)


class Conversation:
    def __init__(self, model, processor, system: TASTESegment | None = None, prompt_format: str = CONTINUATION,
                 max_tokens: int = 4096, max_turns: int = 64, cache_kind: str = "auto", lm_batch=None):
        """``model``: a TasteForCausalLM (anything with ``.spoken_lm`` and ``.audio_tower.vq.rvq``);
        ``processor``: anything with ``.llm_tokenizer``. ``max_tokens`` bounds the cached rows
        of the committed history, ``max_turns`` its number of turns (system excluded).
        ``cache_kind``: the LM cache (``TasteSpokenLM.new_cache``; 'auto' = static with CUDA-graph
        decode steps on CUDA, sized for the window plus a reply); ``lm_batch``: an ``LMStepBatch``
        whose slot holds the cache instead (``cache_kind`` is then unused)."""
        if system is not None and (not isinstance(system, TASTESegment) or system.role != "system"):
            raise ValueError("the system segment must be a TASTESegment with role 'system'")
        if not hasattr(model, "spoken_lm") or not hasattr(processor, "llm_tokenizer"):
            raise ValueError(f"Conversation(model, processor) takes a TasteForCausalLM and a TasteProcessor, got "
                             f"{type(model).__name__} and {type(processor).__name__}")
        for name, value in (("max_tokens", max_tokens), ("max_turns", max_turns)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.model = model
        self.processor = processor
        self.format = PromptFormat(model.spoken_lm, model.audio_tower.vq.rvq, processor.llm_tokenizer, prompt_format)
        self.max_tokens, self.max_turns = int(max_tokens), int(max_turns)
        if system is not None:
            self._check_system_fits(system)
        if cache_kind not in CACHE_KINDS:  # fail here, not in the middle of a call
            raise ValueError(f"cache_kind must be one of {CACHE_KINDS}, got {cache_kind!r}")
        self.cache_kind = cache_kind
        if lm_batch is not None and lm_batch.lm is not model.spoken_lm:
            raise ValueError("lm_batch belongs to another model: make it with LMStepBatch(model.spoken_lm)")
        self.lm_batch = lm_batch
        self.state = ConversationState(system=system)
        self.closed = False
        # Who holds the conversation now (a reply being generated, or a method running): two users
        # at once would crop or feed the cache under each other, so the second one raises.
        # re-entrant: an abandoned reply's finalizer (releasing its claim) may run on a thread inside _claim
        self._lock = threading.RLock()
        self._holder: tuple[object, str] | None = None

    # -- one user at a time -----------------------------------------------------------------------------
    def _claim(self, what: str) -> object:
        """Take the conversation for ``what`` ('reply' for a generation); returns the token that
        releases it. Raises when someone else holds it."""
        with self._lock:
            if self._holder is not None:
                held = self._holder[1]
                if held == "reply":
                    raise RuntimeError(REPLY_IN_PROGRESS)
                raise RuntimeError(f"another thread is running Conversation.{held}() on this conversation: "
                                   "a Conversation serves one caller at a time")
            token = object()
            self._holder = (token, what)
            return token

    def _release(self, token: object) -> None:
        with self._lock:
            if self._holder is not None and self._holder[0] is token:  # never someone else's claim
                self._holder = None
            ended = self.closed and self._holder is None
        if ended:  # closed while a reply ran (left its ``with`` block on an error): its slot goes back now
            self._drop_cache()

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        token = self._claim(what)
        try:
            yield
        finally:
            self._release(token)

    @property
    def reply_in_progress(self) -> bool:
        """True while a streaming_generate iterator on this conversation is open."""
        holder = self._holder
        return holder is not None and holder[1] == "reply"

    def _check_system_fits(self, system: TASTESegment) -> None:
        """The window never drops the system segment: it must leave room for the conversation."""
        check_no_special_ids(self.processor, system.text_ids, "the system segment's text_ids")
        rows = self.format.sos_rows().shape[1] + self.format.segment_rows(system, None)[0].shape[1]
        if rows > self.max_tokens // 2:
            raise ValueError(f"the system segment takes {rows} LM rows, more than half of max_tokens={self.max_tokens}: "
                             f"shorten it or raise max_tokens (history_max_tokens) to at least {2 * rows}")

    @property
    def prompt_format(self) -> str:
        return self.format.name

    @property
    def model_identity(self) -> tuple:
        """What a snapshot's cache rows depend on: the checkpoint and the LM's shape, dtype and device."""
        config = getattr(self.lm, "causal_lm", None)
        config = getattr(config, "config", None)
        shape = tuple(getattr(config, name, None) for name in ("vocab_size", "hidden_size", "num_hidden_layers"))
        name = getattr(getattr(self.model, "config", None), "_name_or_path", None)
        weight = self.lm.embed_tokens.weight
        return (name, *shape, str(weight.dtype), str(weight.device))

    @property
    def lm(self):
        return self.model.spoken_lm

    @property
    def system(self) -> TASTESegment | None:
        return self.state.system

    @property
    def turns(self) -> list[TASTESegment]:
        return list(self.state.turns)

    # -- the cache ------------------------------------------------------------------------------
    def _feed(self, decode: LMDecodeState, rows: torch.Tensor) -> None:
        """Feed ``rows`` to ``decode``'s cache. An LM that fails midway (out of memory, an
        interrupt) may leave its layers at different lengths: that cache is dropped, and the next
        use prefills the history as it then stands (a turn is only added after its rows are in)."""
        try:
            self.lm.feed(decode, rows)
        except BaseException:
            _close_cache(decode)
            self._drop_cache()
            raise

    @torch.no_grad()
    def _rebuild(self) -> None:
        """Prefill the whole committed history (first use, or after the window moved / a turn in
        the middle changed). A failure on the way (out of memory, an interrupt) drops the cache - the
        history it held is no longer the conversation's (the window may have moved already) - so
        the next use prefills the history as it then stands, instead of finding some other history
        in the cache, or none."""
        if self.closed:
            raise RuntimeError("this conversation was closed: start a new Conversation")
        try:
            self._prefill_history()
        except BaseException:
            self._drop_cache()
            raise

    def _prefill_history(self) -> None:
        st = self.state
        identity = self.model_identity
        now = (self.lm.lm_dtype, self.lm.embed_tokens.weight.device)
        if self.lm_batch is not None and (self.lm_batch.dtype, self.lm_batch.device) != now:
            raise ValueError(f"the LMStepBatch holds {self.lm_batch.dtype} rows on {self.lm_batch.device}, the model is "
                             f"now {now[0]} on {now[1]} (cast or moved after the batch was made): make a new "
                             "LMStepBatch for it, and new conversations")
        rows, input_ids = [self.format.sos_rows()], []
        carry = None
        if st.system is not None:
            r, ids, carry = self.format.segment_rows(st.system, carry)
            rows.append(r)
            input_ids.extend(ids)
        turn_rows, turn_ids, turn_carry = [], [], []
        for turn in st.turns:
            turn_carry.append(carry)
            r, ids, carry = self.format.segment_rows(turn, carry)
            rows.append(r)
            input_ids.extend(ids)
            turn_rows.append(r.shape[1])
            turn_ids.append(len(ids))
        if st.decode is not None and isinstance(st.decode.cache, StaticLMCache) and self.lm_batch is None \
                and st.model_identity == identity:
            cache = st.decode.cache  # refilled in place: its buffers and captured decode step stay
            # (a batched conversation's private copy, after restore(), goes back to the batch instead)
            cache.crop(0)
        else:
            self._drop_cache()
            cache = (self.lm_batch.open() if self.lm_batch is not None
                     else self.lm.new_cache(self.cache_kind, self.max_tokens + REPLY_ROWS))
        decode = self.lm.new_decode_state(cache=cache)
        decode.input_ids.extend(input_ids)
        self._feed(decode, torch.cat(rows, dim=1))
        st.turn_rows, st.turn_ids, st.turn_carry = turn_rows, turn_ids, turn_carry
        st.decode, st.carry, st.model_identity = decode, carry, identity
        self._mark_committed()

    def _mark_committed(self) -> None:
        st = self.state
        st.committed_rows = st.decode.length
        st.committed_ids = len(st.decode.input_ids)
        st.committed_hidden = st.decode.last_hidden
        st.reply_opening = 0

    @torch.no_grad()
    def _cut(self, rows: int, ids: int) -> None:
        """Keep the first ``rows`` cache rows and ``ids`` penalty ids; the last kept row is fed
        again so its hidden state (the next step's input) is known."""
        decode = self.state.decode
        last = decode.inputs_embeds()[:, rows - 1: rows]
        decode.crop(rows - 1)
        self._feed(decode, last)
        del decode.input_ids[ids:]

    def ready(self) -> LMDecodeState:
        """The decode state holding exactly the committed history (rows of an abandoned reply are
        dropped)."""
        with self._exclusive("ready"):
            return self._ready()

    def _ready(self, move_window: bool = True) -> LMDecodeState:
        """(``move_window=False``: for a caller about to cut the history at a turn it has found,
        which a window move would shift)"""
        st = self.state
        if st.decode is not None and st.model_identity != self.model_identity:
            self._drop_cache()  # the model was cast or moved since its rows were made: made again from the turns
        if move_window and self.window_due and self._apply_window():  # a move left for between turns that did not happen
            return st.decode  # (the kept history, prefilled)
        if st.decode is None:
            self._rebuild()
        elif st.decode.length != st.committed_rows:
            st.decode.crop(st.committed_rows)
            del st.decode.input_ids[st.committed_ids:]
            st.decode.last_hidden = st.committed_hidden
            st.reply_opening = 0
        return st.decode

    # -- the window -----------------------------------------------------------------------------------
    @property
    def window_due(self) -> bool:
        """The committed history is past ``max_turns`` or ``max_tokens`` (after a reply): the
        window moves at ``move_window()``, else before the next turn or reply is fed."""
        st = self.state
        return len(st.turns) > self.max_turns or st.committed_rows > self.max_tokens

    def move_window(self) -> bool:
        """Make a due window move now: drop the oldest exchanges and prefill what is kept. Call it
        between turns (after a reply is committed and cut to what was heard), where the prefill
        holds up no one. Returns whether the window moved."""
        with self._exclusive("move_window"):
            return self._apply_window()

    def _move_window_if_free(self) -> None:
        """``move_window`` unless someone holds the conversation already (who then makes the move
        when it feeds). A failing prefill drops the cache (``_rebuild``): the next use prefills
        the history again and raises there, if it must."""
        with self._lock:
            if self._holder is not None or self.closed or not self.window_due:
                return
            token = object()
            self._holder = (token, "move_window")
        try:
            self._apply_window()
        except Exception:
            pass
        finally:
            self._release(token)

    # -- turns ----------------------------------------------------------------------------------------
    def add_turn(self, segment: TASTESegment) -> None:
        """Append a committed turn (user speech or text; an assistant turn given from outside)."""
        with self._exclusive("add_turn"):
            self._add_turn(segment)

    @torch.no_grad()
    def _add_turn(self, segment: TASTESegment) -> None:
        if not isinstance(segment, TASTESegment):
            raise ValueError(f"turns must be TASTESegment objects, got {type(segment).__name__}")
        check_no_special_ids(self.processor, segment.text_ids, f"the {segment.role} segment's text_ids")
        st = self.state
        if segment.role == "system":
            if st.system is None and not st.turns:
                self._check_system_fits(segment)
                _close_cache(st.decode)
                st.system, st.decode = segment, None
                return
            raise ValueError("a system segment can only open a conversation (pass it as Conversation(system=...))")
        decode = self._ready()
        rows, ids, carry = self.format.segment_rows(segment, st.carry)
        self._feed(decode, rows)
        decode.input_ids.extend(ids)
        st.turns.append(segment)
        st.turn_rows.append(rows.shape[1])
        st.turn_ids.append(len(ids))
        st.turn_carry.append(st.carry)
        st.carry = carry
        self._mark_committed()
        self._apply_window()

    def begin_reply(self, eos_id: int | None = None):
        """Feed the reply's opening rows after the committed history; returns the ReplyOpening."""
        with self._exclusive("begin_reply"):
            return self._begin_reply(eos_id)

    @torch.no_grad()
    def _begin_reply(self, eos_id: int | None = None):
        decode = self._ready()
        opening = self.format.reply_opening(self.state.carry, eos_id)
        if opening.rows is not None:
            self._feed(decode, opening.rows)
            decode.input_ids.extend(opening.opening_ids)
        self.state.reply_opening = 0 if opening.rows is None else opening.rows.shape[1]
        return opening

    def commit_reply(self, reply: TASTESegment | None) -> None:
        """Close the reply whose rows the generation fed (opening + one row per token)."""
        with self._exclusive("commit_reply"):
            self._commit_reply(reply)

    @torch.no_grad()
    def _commit_reply(self, reply: TASTESegment | None) -> None:
        st = self.state
        if reply is None:
            self._ready()  # nothing was said: drop the opening rows
            return
        decode = st.decode
        expected = st.committed_rows + st.reply_opening + reply.length
        if decode is None or decode.length != expected:
            raise ValueError(f"the cache holds {0 if decode is None else decode.length} rows but this reply needs "
                             f"{expected}: commit_reply must directly follow the generation of this reply")
        rows, ids, carry = self.format.reply_closing(reply)
        if rows is not None:
            self._feed(decode, rows)
            decode.input_ids.extend(ids)
        st.turns.append(reply)
        st.turn_rows.append(decode.length - st.committed_rows)
        st.turn_ids.append(len(decode.input_ids) - st.committed_ids)
        st.turn_carry.append(st.carry)
        st.carry = carry
        self._mark_committed()  # (past a limit now: the window moves between turns, see window_due)

    def truncate_last_assistant(self, played_words: int) -> TASTESegment | None:
        """Keep only the first ``played_words`` words of the last assistant turn (barge-in: what
        the caller actually heard); returns the kept turn (None when nothing was kept). When that
        turn is the newest one the cache is cut in place (no re-prefill). The last assistant turn
        is found wherever it is: after a reply cancelled before its first word (``reply`` None,
        nothing committed) it is an earlier reply, so do not call this then."""
        with self._exclusive("truncate_last_assistant"):
            return self._truncate_last_assistant(played_words)

    @torch.no_grad()
    def _truncate_last_assistant(self, played_words: int) -> TASTESegment | None:
        if isinstance(played_words, bool) or not isinstance(played_words, numbers.Integral) or played_words < 0:
            raise ValueError(f"played_words must be an integer >= 0, got {played_words!r}")
        played_words = int(played_words)  # (a numpy integer too)
        st = self.state
        index = next((i for i in range(len(st.turns) - 1, -1, -1) if st.turns[i].role == "assistant"), None)
        if index is None:
            raise ValueError("there is no assistant turn to truncate")
        turn = st.turns[index]
        kept = turn.first_words(played_words) if turn.modality == "audio" else (turn if played_words else None)
        if kept is turn:
            return turn
        if index != len(st.turns) - 1 or st.decode is None:  # in the middle of the history: rebuild later
            if kept is None:
                del st.turns[index]
            else:
                st.turns[index] = kept
            _close_cache(st.decode)
            st.decode = None
            return kept
        self._ready(move_window=False)
        start_rows = st.committed_rows - st.turn_rows[index]
        start_ids = st.committed_ids - st.turn_ids[index]
        carry_before = st.turn_carry[index]
        del st.turns[index], st.turn_rows[index], st.turn_ids[index], st.turn_carry[index]
        try:
            if kept is None:
                self._cut(start_rows, start_ids)
                st.carry = carry_before
                self._mark_committed()
                return None
            # The kept turn's rows are a prefix of the old ones up to its content; its closing rows
            # (if any) differ and are fed again.
            rows, ids, carry = self.format.segment_rows(kept, carry_before)
            closing_rows, closing_ids, _ = self.format.reply_closing(kept)
            n_close = 0 if closing_rows is None else closing_rows.shape[1]
            self._cut(start_rows + rows.shape[1] - n_close, start_ids + len(ids) - len(closing_ids))
            if closing_rows is not None:
                self._feed(st.decode, closing_rows)
                st.decode.input_ids.extend(closing_ids)
        except BaseException:
            # All or nothing: the history holds the words heard all the same, and the cache, cut
            # part way, is prefilled again at its next use.
            if kept is not None:
                st.turns.append(kept)
            self._drop_cache()
            raise
        st.turns.append(kept)
        st.turn_rows.append(rows.shape[1])
        st.turn_ids.append(len(ids))
        st.turn_carry.append(carry_before)
        st.carry = carry
        self._mark_committed()
        return kept

    def forget_from(self, segment: TASTESegment) -> int:
        """Forget ``segment`` (a committed turn, found by identity) and every turn after it, as if
        they had never been added: a user turn that turned out not to be over (the caller went on
        speaking) and the reply begun to it. Returns the number of turns forgotten (0 when
        ``segment`` is not in the history). The cache is cut in place; turns the rolling window
        dropped meanwhile stay dropped."""
        with self._exclusive("forget_from"):
            return self._forget_from(segment)

    def _forget_from(self, segment: TASTESegment) -> int:
        st = self.state
        index = next((i for i in range(len(st.turns) - 1, -1, -1) if st.turns[i] is segment), None)
        return 0 if index is None else self._forget_at(index)

    @torch.no_grad()
    def _forget_at(self, index: int) -> int:
        """Forget the turns from position ``index`` on; returns how many."""
        st = self.state
        forgotten = len(st.turns) - index
        if st.decode is None:  # no cache yet: the next use prefills what is left
            del st.turns[index:], st.turn_rows[index:], st.turn_ids[index:], st.turn_carry[index:]
            return forgotten
        self._ready(move_window=False)
        rows, ids, carry = sum(st.turn_rows[index:]), sum(st.turn_ids[index:]), st.turn_carry[index]
        del st.turns[index:], st.turn_rows[index:], st.turn_ids[index:], st.turn_carry[index:]
        self._cut(st.committed_rows - rows, st.committed_ids - ids)
        st.carry = carry
        self._mark_committed()
        return forgotten

    def _history_mark(self) -> tuple:
        """The history as it stands, without the cache (cheap), for ``_back_to``."""
        st = self.state
        return st.system, list(st.turns), list(st.turn_rows), list(st.turn_ids), list(st.turn_carry)

    def _back_to(self, mark: tuple) -> None:
        """The history of ``mark`` again. Turns added since are cut off the cache in place; when
        the window rolled meanwhile (or a system segment was set), the history of ``mark`` comes
        back whole and is prefilled on next use."""
        st = self.state
        system, turns = mark[0], mark[1]
        if st.system is system and len(st.turns) >= len(turns) and all(a is b for a, b in zip(st.turns, turns)):
            if len(st.turns) > len(turns):
                self._forget_at(len(turns))
            return
        st.system, st.turns, st.turn_rows, st.turn_ids, st.turn_carry = mark[0], *(list(m) for m in mark[1:])
        self._drop_cache()

    def _apply_window(self) -> bool:
        """Past ``max_turns`` or ``max_tokens``, drop the oldest exchanges - a turn with the replies
        after it, so that the history never opens with an answer to a dropped question - down to
        ``WINDOW_LOW_WATER`` of either limit, then prefill what is kept. The newest exchange (the
        turn being answered, or a reply with its question) stays even beyond the limits: it is what
        the next step is about. Several replies in a row to one question stay with it while they fit
        the limits; past them only the newest reply is kept (a history of replies only is still
        bounded)."""
        st = self.state
        if not self.window_due:
            return False
        keep_from = question = len(st.turns) - 1
        while question > 0 and st.turns[question].role == "assistant":
            question -= 1
        fits = len(st.turns) - question <= self.max_turns and sum(st.turn_rows[question:]) <= self.max_tokens
        if st.turns[question].role != "assistant" and (question == keep_from - 1 or fits):
            keep_from = question  # the newest reply keeps its question (so do several in a row, while they fit)
        turns_goal, rows_goal = max(1, int(self.max_turns * WINDOW_LOW_WATER)), int(self.max_tokens * WINDOW_LOW_WATER)
        drop, rows = 0, st.committed_rows
        while drop < keep_from and (len(st.turns) - drop > turns_goal or rows > rows_goal):
            rows -= st.turn_rows[drop]
            drop += 1
            while drop < keep_from and st.turns[drop].role == "assistant":
                rows -= st.turn_rows[drop]
                drop += 1
        if drop:  # every later row's position changes: prefill the kept history again
            del st.turns[:drop], st.turn_rows[:drop], st.turn_ids[:drop], st.turn_carry[:drop]
            self._rebuild()
        return drop > 0

    # -- snapshots ------------------------------------------------------------------------------------
    def snapshot(self) -> ConversationState:
        """A deep copy of the whole state (cache, window bookkeeping); the segments themselves, never
        changed in place, are shared."""
        with self._exclusive("snapshot"):
            if self.state.model_identity != self.model_identity:
                self._drop_cache()  # rows of a model since cast or moved: the restored state makes them again
            memo = {id(segment): segment for segment in self.state.segments}
            snapshot = copy.deepcopy(self.state, memo)
        snapshot.prompt_format, snapshot.model_identity = self.prompt_format, self.model_identity
        return snapshot

    def restore(self, snapshot: ConversationState) -> None:
        """Put a snapshot back (in a batched conversation the restored cache is a private one).
        The snapshot must come from a conversation in the same prompt format on the same model
        (checkpoint, dtype, device): its cache rows are only valid there."""
        if self.closed:
            raise RuntimeError("this conversation was closed: restore the snapshot into a new Conversation")
        if not isinstance(snapshot, ConversationState):
            raise ValueError("restore() takes what snapshot() returned")
        if snapshot.prompt_format is None or snapshot.model_identity is None:
            raise ValueError("this ConversationState was not made by snapshot(): restore() takes what snapshot() returned")
        if snapshot.prompt_format != self.prompt_format:
            raise ValueError(f"the snapshot is of a {snapshot.prompt_format!r} conversation, this one is "
                             f"{self.prompt_format!r}: restore it into a Conversation with "
                             f"prompt_format={snapshot.prompt_format!r}")
        if snapshot.model_identity != self.model_identity:
            raise ValueError(f"the snapshot was made with another model {snapshot.model_identity} (checkpoint, "
                             f"vocab, hidden size, layers, dtype, device), this conversation's is "
                             f"{self.model_identity}: its cache rows are only valid for that model")
        # the conversation never changes a segment in place: share them, so that forget_from still
        # finds the caller's objects
        memo = {id(segment): segment for segment in snapshot.segments}
        restored = copy.deepcopy(snapshot, memo)
        cache = getattr(restored.decode, "cache", None)
        if isinstance(cache, StaticLMCache) and self.lm_batch is None:
            # a copy holds only its rows: a live cache's room again (a batched conversation's goes
            # back to the batch at its next prefill)
            cache.reserve(self.max_tokens + REPLY_ROWS)
        with self._exclusive("restore"):
            _close_cache(self.state.decode)
            self.state = restored

    def _drop_cache(self) -> None:
        """Forget the cache (the next use prefills the history again): after it failed mid-feed."""
        _close_cache(self.state.decode)
        self.state.decode = None

    def close(self) -> None:
        """End of the conversation: give its cache's slot back (batched caches; otherwise the
        cache is just dropped). The history stays readable; feeding it again is an error. Raises
        while a reply is being generated (close or finish its iterator first)."""
        with self._exclusive("close"):
            self.closed = True
            self._drop_cache()

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.close()
        except RuntimeError:
            if exc_type is None:
                raise
            # Leaving on an error with a reply still open: the caller's error is the one to see. No
            # more use; the reply's iterator frees the conversation when it is closed or dropped.
            self.closed = True


def _close_cache(decode: LMDecodeState | None) -> None:
    close = getattr(getattr(decode, "cache", None), "close", None)
    if close is not None:
        close()
