"""How a same-GPU tenant orders its calls on its GPU (client/transports/local.py): the mailbox's
two words, the CUDA stream calls are made on, and the watchdog.

Our stream writes a call's input_seq to the mailbox's input word once its copy-in is done; the
executor's stream writes it to the output word once the result is in, and our stream waits for
that before reading the result. So a call returns as soon as it is sent and no host waits for
the other's GPU. Every call reuses the mailbox's bytes and words, so a call made on another
stream than the last call is ordered after it. Where the words cannot be mapped, the mailbox's
interprocess events order a call instead, and the call waits for its reply.

When the executor dies or detaches us, nothing writes the output word any more: the watchdog, a
thread, writes it so that our GPU's waits end, even while the caller's host is blocked in a
synchronise behind them. It also takes replies and releases failed calls meanwhile
(client/transports/unanswered.py), and never needs the transport's lock to do so.
"""
from __future__ import annotations

import threading
import time
import warnings
import weakref

import torch

from symbiont.client.transports.unanswered import RELEASE_POLL_US, Unanswered
from symbiont.proto.cuda_ipc import OpenedRegion, copy_async, stream_wait, stream_write

WATCH_S = 0.05  # the watchdog's period


class StreamOrder:
    """The order of one mailbox's calls on our GPU: the executor's, or a peer of it. On a peer our
    stream copies the input across, writes the input word, waits for the output word and copies
    the result back, exactly as on the executor's GPU; only without words (its events belong to
    the executor's GPU) does a peer's call order on the executor's GPU instead."""

    def __init__(self, region: OpenedRegion, device: torch.device | None = None):
        self.region = region  # the mailbox's data area on the executor's GPU, and its events
        self.device = device or region.device  # where our calls' streams are
        self.words = 0  # device address of the input word, when our GPU writes it
        self.out_word = 0  # device address of the output word, when the executor's GPU writes it
        self.seq = 0  # the last input_seq written to the input word (a new mailbox's words start at 0)
        self.stream: int | None = None  # the CUDA stream (cudaStream_t) of the last call
        self._switched: torch.cuda.Event | None = None  # orders a call on another stream after the last
        self.page: torch.Tensor | None = None  # the words page as an int32 tensor (step programs' kernels)
        self.device_words = 0  # address of the region's device words (proto/mailbox.py DEVICE_WORDS), 0: none
        self.device_page: torch.Tensor | None = None  # ... as an int32 tensor

    def map_words(self, box, output_word: bool, url: str) -> None:
        """Lets our GPU write the mailbox's input word and (output_word) wait on its output word;
        without it, calls record the input_ready event and wait for their replies."""
        try:
            self.words, out_word = box.map_words(self.device)
        except RuntimeError as e:  # (calls still work, each waiting for its reply)
            warnings.warn(f"{url}: the mailbox's words could not be mapped for {self.device} ({e}); "
                          "calls will wait for their replies", RuntimeWarning, stacklevel=3)
            self.device = self.region.device  # (the events order calls there)
            return
        if output_word:
            self.out_word = out_word

    def current_stream(self) -> int:
        """The cudaStream_t of our device's current stream (0.4 µs of host time against 5.8-7.6 µs
        for torch.cuda.current_stream: benchmarks/RESULTS.md, S6 pieces)."""
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def follow(self, stream: int) -> None:
        """Orders a call made on `stream` after the last call, when that was on another stream."""
        last = self.stream
        if last is not None and last != stream:
            if self._switched is None:
                self._switched = torch.cuda.Event()
            self._switched.record(torch_stream(last, self.device))
            torch_stream(stream, self.device).wait_event(self._switched)
        self.stream = stream

    def copy_in(self, x: torch.Tensor, stream: int) -> None:
        """Queues the copy of x (contiguous, on our GPU) to the start of the data area on `stream`
        (x.copy_ for a fraction of its host time: csrc/stream_ops.cpp)."""
        copy_async(self.region.ptr, x.data_ptr(), x.numel() * x.element_size(), stream, self.device)

    @property
    def peer(self) -> bool:
        """Whether our calls' streams are on another GPU than the data area."""
        return self.device != self.region.device

    def copy_out(self, view: torch.Tensor, stream: int) -> torch.Tensor:
        """A fresh copy of `view` (of the data area) on our peer GPU, queued on `stream`."""
        y = torch.empty(view.shape, dtype=view.dtype, device=self.device)
        copy_async(y.data_ptr(), view.data_ptr(), y.numel() * y.element_size(), stream, self.device)
        return y

    def input_in(self, stream: int, word: bool = True) -> int:
        """Marks the input copied in so far on `stream` as complete: writes the next input_seq to
        the input word (returned), or, without words or with word=False (a copy from a peer GPU,
        whose streams cannot write our words), records input_ready (returns 0)."""
        if not (self.words and word):
            self.region.input_ready.record(torch_stream(stream, self.device))
            return 0
        self.seq = self.seq % 0xFFFFFFFF + 1  # never 0, which means "no word"
        stream_write(stream, self.words, self.seq)
        return self.seq

    def wait_result(self, stream: int, seq: int) -> None:
        """Our stream waits for the executor's writes of a call: for the output word to reach
        `seq`, or (0) for output_ready."""
        if seq:
            stream_wait(stream, self.out_word, seq)
        else:
            torch_stream(stream, self.device).wait_event(self.region.output_ready)

    def release_all(self, unanswered: Unanswered, timeout_s: float = 60.0) -> None:
        """Lets every wait of our stream for the output word go (when calls are unanswered, or the
        executor is gone or has detached us, no result may come for them), until the stream has
        passed them: a write the executor's GPU had queued may land after ours and set the word
        back."""
        stream = torch_stream(self.stream, self.device) if self.stream is not None else None
        deadline = time.monotonic() + timeout_s
        while True:
            unanswered.release_every(self.seq)
            if stream is None or stream.query() or time.monotonic() > deadline:
                return
            time.sleep(RELEASE_POLL_US * 1e-6)

    def close(self, box) -> None:
        """Drops the data area (after our GPU is done with it) and the words mapping."""
        if self.peer:
            try:
                torch.cuda.synchronize(self.device)  # (our streams read and write the data area too)
            except Exception:
                pass
        try:
            self.region.close()  # synchronises: no queued write of ours touches the words after
        except Exception:  # the executor may be gone; its memory goes with it
            pass
        self.page = None
        if self.words:
            try:
                box.unmap_words(self.device)
            except RuntimeError:
                pass
            self.words = self.out_word = 0


def torch_stream(stream: int, device: torch.device) -> torch.cuda.Stream:
    """torch's object for the raw cudaStream_t `stream` of `device`. The default stream's handle
    is 0, and torch.cuda.ExternalStream(0) is not that stream but a fresh one of torch's pool:
    work recorded or waited on there is ordered with nothing of ours."""
    return torch.cuda.default_stream(device) if stream == 0 else torch.cuda.ExternalStream(stream, device=device)


def start_watchdog(transport) -> threading.Thread:
    """The watchdog of one transport (client/transports/local.py): while our GPU may wait for the
    output word, takes replies and releases failed calls, and once the executor is gone or has
    detached us, writes the word so that every wait ends. Runs until the transport is closed or
    dropped (a grow replaces the mailbox for a moment)."""
    thread = threading.Thread(target=_watch, args=(weakref.ref(transport),), name="symbiont-watchdog", daemon=True)
    thread.start()
    return thread


def _watch(ref) -> None:
    while True:
        time.sleep(WATCH_S)
        t = ref()
        if t is None or (t.tenant_id == 0 and t._box is None):
            return
        order = t._order
        if order is not None and order.out_word and t._unanswered.watch(order.seq, t._executor_alive, order):
            t._gone = f"the executor at {t.url} (pid {t._executor_pid}) is gone, or detached this tenant"
        box = t._box
        if t._gone and t._program_headers and box is not None:  # (each step program's run queued sets its word back)
            box.release_program(output=True)
        del t, order
