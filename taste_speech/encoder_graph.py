"""The audio tower's Whisper encoder as one captured step (a CUDA graph on CUDA), shared by the calls.

Any Whisper encoder with the tower's encoder interface (``encoder``, ``whisper_config``,
``num_frames``, ``encoder_stack``) runs the same way: the built-in ASR's runs through one too
(``pipecat_taste.whisper_decode.WhisperEncoderStack``).

The encoder always runs at one shape - the turn's log-mel right-padded to the whole window (30 s,
3000 frames, for the published model) - so it needs no buckets: one graph serves every turn. Eager
it is ~500 launches and launch-bound on a GPU (our H100 notes, docs/GPU.md: 16 ms for Whisper-large-v3's
encoder, the same for 3 s or 30 s of audio); replayed, what is left is the GPU's own work.

Calls share one :class:`EncoderGraph`. With ``rows`` > 1 the turns of several calls that end
together go through one pass (a step per row count n = 1, 2, 4 ... rows, idle rows silent): every
turn waits in one queue, and the first thread that finds no pass running runs the next one for up
to ``rows`` waiting turns. A turn announced by its call (``expect_turn``: its caller stopped
speaking, its transcript is being finished) is waited for, at most ``gather`` passes
(``taste_speech.announcements``: on a GPU the calls' turns otherwise come a few milliseconds apart
and never meet). A call alone never waits.

Streams: each turn's window is made on its caller's current stream, and a pass may run on another
caller's; the pass waits for each window (an event), and each caller's stream waits for the pass
before it reads its copies. Each pass also waits for the last one's queued kernels (its buffers
are reused), which calls running on streams of their own do not wait for otherwise.

It is passed explicitly (``taste_tokenize(..., encoder=...)``; ``TasteEngine`` makes one on the
CUDA fast path), so a model shared by an eager engine and a graphed one keeps both.

One pass for the ASR and the tower: the published tower's Whisper encoder is Whisper-large-v3's,
frozen (``TASTE_ARCHITECTURE.md`` section 3.2), so a built-in Whisper ASR whose encoder has the
same weights encodes the same window into the same states. Such an ASR runs its passes through the
tower's ``EncoderGraph`` (``WhisperTranscriber.share_encoder``; the engine checks the weights
tensor by tensor) and hands the outputs of a turn's final transcription on as an
:class:`EncodedTurn`, which ``taste_tokenize(..., encoded=...)`` uses instead of a second pass when
its audio is the turn's. Moving or
casting the tower is detected and the steps are rebuilt. Its memory: the input windows, the two
outputs and the graphs' shared private pool (the largest layer's activations) for ``rows`` turns.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from taste_speech.announcements import Announcements, StepTimer
from taste_speech.batched_steps import step_sizes
from taste_speech.step_graph import StepGraph, all_captured, first_fallback_reason


class EncodedTurn:
    """The tower encoder's outputs for one turn's window (``(target_hidden, last_hidden)``, each
    (1, S, d)), made already, with the 16 kHz mono audio whose window it was. ``ready``: on CUDA an
    event after they were written (made on another call's stream: ``use_here`` waits for it)."""

    __slots__ = ("audio", "outputs", "ready")

    def __init__(self, audio, outputs: tuple, ready=None):
        self.audio, self.outputs, self.ready = audio, tuple(outputs), ready

    def matches(self, audio16k) -> bool:
        """Whether ``audio16k`` (the tower's 16 kHz mono float32 input) is the audio these came from."""
        import numpy as np

        return self.audio is audio16k or np.array_equal(self.audio, audio16k)

    def use_here(self) -> tuple:
        """The outputs, for this thread's current stream: it waits for them, and they are not
        freed for reuse before its kernels that read them have run."""
        if self.ready is not None:
            use_on_current_stream(self.outputs, self.ready)
        return self.outputs


class _Turn:
    """One call's window waiting for a pass, and what it gets back."""

    __slots__ = ("window", "owner", "ready", "output", "done")

    def __init__(self, window: torch.Tensor, owner=None):
        self.window, self.owner = window, owner
        self.ready = event_after_current_work(window.device)  # CUDA: the window is written
        self.output = None  # (target, last), or the exception the pass raised
        self.done = None  # CUDA: the pass and the copies are written


def use_on_current_stream(outputs, written) -> None:
    """(CUDA.) Let this thread's current stream read ``outputs``, made on another stream: it waits
    for the event ``written``, and their memory is not reused before its kernels have read them."""
    stream = torch.cuda.current_stream(outputs[0].device)
    stream.wait_event(written)
    for out in outputs:
        out.record_stream(stream)


def event_after_current_work(device: torch.device):
    """CUDA: an event after the work queued so far on this thread's stream (another stream can
    wait for it); None elsewhere."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class EncoderGraph:
    def __init__(self, tower, graph_mode: str = "auto", rows: int = 1, gather: float = 1.0):
        """``tower``: a ``TasteAudioTower`` (or the same interface: ``encoder_stack(window)`` returns
        a tuple of (rows, S, d) tensors); ``graph_mode`` as ``step_graph.StepGraph`` takes it
        ('auto': a CUDA graph on CUDA, eager elsewhere; 'rehearse': the capture protocol on any
        device). ``rows``: the most turns one pass runs. ``gather``: how long a pass waits for
        announced turns, in passes (0: never)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        if isinstance(gather, bool) or not isinstance(gather, (int, float)) or not math.isfinite(gather) or gather < 0:
            raise ValueError(f"gather must be a number of passes >= 0, got {gather!r}")
        self.tower, self.graph_mode, self.rows, self.gather = tower, graph_mode, rows, float(gather)
        self.row_counts = step_sizes(rows)
        self._lock = threading.Condition()
        self._queue: list[_Turn] = []
        self._stepping = False
        self._ending = Announcements()  # calls whose turn ended and whose pass has not come yet
        self._pass_time = StepTimer()  # a pass's time on the device (how long announced turns are waited for)
        self.passes = 0
        self.turns = 0
        self._last_turn = None  # CUDA: an event after the last pass and its copies
        self._reset()

    @property
    def mode(self) -> str:
        return self.step.mode

    @property
    def step(self) -> StepGraph:
        """The one-turn step."""
        return self._step(1)

    @property
    def captured(self) -> bool:
        """Every step made so far is a captured graph (and one was made)."""
        return all_captured(self._steps.values())

    @property
    def fallback_reason(self) -> str | None:
        """Why a step runs eagerly where a graph was asked for, if one does."""
        return first_fallback_reason(self._steps.values())

    def stats(self) -> dict:
        with self._lock:
            return {"rows": self.rows, "turns": self.turns, "passes": self.passes,
                    "mean_batch": round(self.turns / self.passes, 3) if self.passes else None,
                    **self._ending.stats()}

    def expect_turn(self, owner) -> None:
        """Announce ``owner``'s next turn (its caller stopped speaking): a pass that starts before
        it comes waits for it a little. Held weakly; ``owner`` passes itself to ``__call__``."""
        if self.rows > 1 and self.gather:
            with self._lock:
                self._ending.add(owner)

    def withdraw_turn(self, owner) -> None:
        """``owner``'s announced turn will not come (it had no words to tokenize): no pass waits for it."""
        with self._lock:
            self._ending.withdraw(owner)

    def __call__(self, window: torch.Tensor, owner=None) -> tuple[torch.Tensor, ...]:
        """``window`` (1, n_mels, frames): the padded log-mel (``tower.encoder_window``) -> the
        stack's outputs, each (1, S, d), the turn's own copies (the tower's: target_hidden,
        last_hidden). ``owner``: who announced this turn (``expect_turn``), if anyone."""
        return self.encode([window], [owner])[0]

    @torch.inference_mode()
    def encode(self, windows: list[torch.Tensor], owners: list | None = None) -> list[tuple[torch.Tensor, ...]]:
        """Several turns brought together (the utterances a transcriber decodes as one batch): each
        window's outputs, as ``__call__`` gives them; they go into the same pass where the rows allow."""
        owners = owners if owners is not None else [None] * len(windows)
        turns = [_Turn(window, owner) for window, owner in zip(windows, owners, strict=True)]
        with self._lock:
            for turn in turns:
                self._ending.arrive(turn.owner)
            self._queue.extend(turns)
            self._lock.notify_all()  # a pass may be waiting for these turns
            while any(turn.output is None for turn in turns):
                if self._stepping:
                    self._lock.wait()
                    continue
                self._stepping = True
                try:
                    self._gather()
                    batch, self._queue = self._queue[:self.rows], self._queue[self.rows:]
                    self._lock.release()
                    try:
                        self._run(batch)
                    finally:
                        self._lock.acquire()
                    self.passes += 1
                    self.turns += len(batch)
                finally:
                    self._stepping = False
                    self._lock.notify_all()
        for turn in turns:
            if isinstance(turn.output, BaseException):
                raise turn.output
        for turn in turns:
            if turn.done is not None:  # made on the pass's stream, used (and freed) on this one
                use_on_current_stream(turn.output, turn.done)
        return [turn.output for turn in turns]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every row count now (on silent windows), so that no turn pays for a capture,
        and time a pass."""
        with self._lock:
            while self._stepping:
                self._lock.wait()
            self._stepping = True
        try:
            self._check_weights()
            silent = torch.zeros_like(self.window[:1])
            for n in reversed(self.row_counts):  # largest first: the others reuse its pool memory
                self._run_or_raise([_Turn(silent) for _ in range(n)])
            cuda = self.window.is_cuda
            if cuda:
                torch.cuda.current_stream(self.window.device).synchronize()
            started = time.perf_counter()
            self._run_or_raise([_Turn(silent)])
            if cuda:
                torch.cuda.current_stream(self.window.device).synchronize()
            self._pass_time.measured(time.perf_counter() - started)
        finally:
            with self._lock:
                self._stepping = False
                self._lock.notify_all()

    # -- internals ------------------------------------------------------------------------------
    def _gather(self) -> None:
        """(Lock held.) Wait for the announced turns, at most ``gather`` passes or until a pass is full."""
        full = lambda: len(self._queue) >= self.rows  # noqa: E731
        here = lambda: {id(t.owner) for t in self._queue if t.owner is not None}  # noqa: E731
        self._ending.gather(self._lock, self.gather * self._pass_time.last() if self.rows > 1 else 0.0, full, here)

    def _run(self, batch: list[_Turn]) -> None:
        """One pass for ``batch`` (lock not held); each turn gets its copies or the error."""
        try:
            self._check_weights()
            device = self.window.device
            stream = torch.cuda.current_stream(device) if self.window.is_cuda else None
            if self._last_turn is not None:  # (a no-op when the last pass ran on this thread's stream)
                stream.wait_event(self._last_turn)
            for row, turn in enumerate(batch):
                if turn.ready is not None:
                    stream.wait_event(turn.ready)
                self.window[row:row + 1].copy_(turn.window)
            n = next(n for n in self.row_counts if n >= len(batch))
            self.window[len(batch):n].zero_()  # idle rows: silence
            timer = self._pass_time.start(device)
            started = time.perf_counter()
            stacked = self._step(n).run()
            outputs = [tuple(out[row:row + 1].clone() for out in stacked) for row in range(len(batch))]
            self._pass_time.stop(timer, time.perf_counter() - started)
            done = event_after_current_work(device)
            self._last_turn = done
        except BaseException as error:  # every turn of this pass fails; the next passes may not
            outputs, done = [error] * len(batch), None
        for turn, output in zip(batch, outputs):
            turn.output, turn.done = output, done

    def _run_or_raise(self, batch: list[_Turn]) -> None:
        self._run(batch)
        if isinstance(batch[0].output, BaseException):
            raise batch[0].output

    def _step(self, n: int) -> StepGraph:
        if n not in self._steps:
            self._steps[n] = StepGraph(lambda: self.tower.encoder_stack(self.window[:n]), self.window.device,
                                       self.graph_mode, pool=self._pool, name=f"audio tower encoder x{n}")
        return self._steps[n]

    def _weights(self):
        weight = self.tower.encoder.conv1.weight
        return weight.device, weight.dtype, weight.data_ptr()

    def _check_weights(self) -> None:
        """A graph replays the weights at the addresses it was captured with: rebuild after a move or cast."""
        if self._weights() != self._fingerprint:
            self._reset()

    def _reset(self) -> None:
        if self._last_turn is not None:  # the old buffers are freed: no queued kernel may still use them
            self._last_turn.synchronize()
            self._last_turn = None
        self._fingerprint = self._weights()
        device, dtype = self._fingerprint[:2]
        shape = (self.rows, self.tower.whisper_config.num_mel_bins, self.tower.num_frames)
        self.window = torch.zeros(shape, device=device, dtype=dtype)
        # one pool for every row count's graph: their passes never overlap, outputs are copied out at once
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" and self.graph_mode != "eager" else None
        self._steps: dict[int, StepGraph] = {}
