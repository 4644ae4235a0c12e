"""Same-host transport (`local://NAME`), tenant side: ZeroMQ for control, the csrc rings and
doorbells for signalling, and the executor's mailbox for tensors: host shared memory, or, when
the tenant sits on the executor's GPU or on a peer GPU of the same host, device memory on the
executor's GPU opened by CUDA IPC handle (the copy-in — a peer copy from another GPU — the
executor's GEMM and the read are ordered on the GPUs; no host synchronisation).

On the executor's own GPU the order is kept by two words of the mailbox page that both GPUs
can read and write: our stream writes a call's input_seq to the input word after the copy-in,
the executor's stream writes it to the output word after the result. A call then returns as
soon as it is sent, its result ordered behind a GPU wait for the output word; its reply is
taken later (client/transports/unanswered.py), at the latest by confirm(), which virtualize()
runs at the end of every forward and backward pass. A watchdog thread releases our GPU's waits
when the executor dies or detaches us while the host is blocked elsewhere (say in a sync).
Elsewhere (peer GPU, host mailbox, an older executor) a call waits for its reply.
"""
from __future__ import annotations

import threading
import time
import warnings
import weakref

import torch
from client.errors import (
    ExecutorUnavailableError,
    InternalError,
    NotAttachedError,
    ResourceExhaustedError,
)
from client.transport import Transport
from client.transports.control import ControlChannel
from proto import codec, mailbox, urls
from client.transports.unanswered import LIVENESS_SLICE_US, RELEASE_POLL_US, Sent, Unanswered, call_name, reply_error
from proto.cuda_ipc import reached, stream_wait, stream_write
from proto.procs import alive
from proto import executor_pb2 as pb
from proto._doorbell import Doorbell

SPIN_US = 20  # a CPU tenant: its executor shares the cores, spinning would slow the GEMMs
GPU_SPIN_US = 200  # a tenant whose data area is on a GPU: a reply takes ~0.2 ms (S6), sleeping costs more
MAX_UNANSWERED = 32  # calls sent before the replies of some are waited for (the rings hold 64)
WATCH_S = 0.05  # the watchdog's period


class LocalTransport(Transport):
    def __init__(self, url: str, name: str):
        super().__init__(url)
        self._channel = ControlChannel(url, urls.control_endpoint(name))
        self._executor_pid = 0
        self._wake_mem = self._wake = None
        self._box: mailbox.Mailbox | None = None
        self._gpu = None  # proto.cuda_ipc.OpenedRegion when the data area is on our GPU
        self._words = 0  # device address of the mailbox's input word, when our GPU writes it
        self._out_word = 0  # device address of its output word, when the executor's GPU writes it
        self._seq = 0  # the last input_seq written there
        self._unanswered = Unanswered()  # calls returned before their replies (same GPU)
        self._gone = ""  # why the watchdog found the executor gone or us detached
        self._watchdog: threading.Thread | None = None
        self._max_data = 0
        self.return_early = True  # same GPU: a call returns before its reply (False: it waits for it)
        self.spin_us: int | None = None  # how long a call spins on its reply before sleeping (None: by placement)
        self._spin = SPIN_US
        self._outstanding: tuple[int, int] | None = None  # (call id, input_seq) of an interrupted call not answered yet
        self._stream: int | None = None  # the CUDA stream (cudaStream_t) of the last same-GPU call
        self._switched = None  # an event that orders a call on another stream after the last

    def _control(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        return self._channel.request(request, timeout_s)

    def _attached(self, reply: pb.AttachReply) -> None:
        if (reply.ring_slots, reply.ring_slot_size, reply.data_offset) != (
            mailbox.RING_SLOTS, mailbox.RING_SLOT_SIZE, mailbox.DATA_OFFSET
        ):
            raise InternalError("the executor uses another mailbox layout: install the same symbiont version on both sides")
        self._executor_pid = self._channel.executor_pid = reply.wake.owner_pid
        self._gone, self._outstanding = "", None  # (of an earlier attach)
        self._wake_mem = mailbox.open_region(reply.wake.owner_pid, reply.wake.fd, reply.wake.size)
        self._wake = Doorbell(self._wake_mem, 0)
        self._map(reply)  # (releases what an earlier mailbox still waited for)
        self._unanswered.abandon()
        self._max_data = reply.max_mailbox_bytes

    def _map(self, reply: pb.AttachReply | pb.GrowReply) -> None:
        """Maps the mailbox (and device region) an attach or grow reply names, dropping the old."""
        self._unmap()
        on_gpu = reply.HasField("cuda")
        region = reply.mailbox
        self._box = mailbox.Mailbox(mailbox.open_region(region.owner_pid, region.fd, region.size), 0 if on_gpu else reply.data_bytes)
        self._data_bytes = reply.data_bytes
        self._spin = self.spin_us if self.spin_us is not None else (GPU_SPIN_US if on_gpu else SPIN_US)
        if on_gpu:
            from proto.cuda_ipc import OpenedRegion

            c = reply.cuda
            self._gpu = OpenedRegion.open(self.area_device, c.size, c.mem_handle, c.input_ready, c.output_ready)
            if c.input_word:
                self._map_words(c.output_word)

    def _map_words(self, output_word: bool) -> None:
        """Lets our GPU write the mailbox's input word (a call's input_seq, once its copy is done),
        which the executor's GPU waits on, and wait on its output word; without it, calls record
        the input_ready event and wait for their replies."""
        self._seq = 0  # a new mailbox's words start at 0
        try:
            self._words, out_word = self._box.map_words(self.area_device)
        except RuntimeError as e:  # (calls still work, each waiting for its reply)
            warnings.warn(f"{self.url}: the mailbox's words could not be mapped for {self.area_device} ({e}); "
                          "calls will wait for their replies", RuntimeWarning, stacklevel=2)
            self._words = 0
            return
        if output_word:
            self._out_word = out_word
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self),), name="symbiont-watchdog", daemon=True)
                self._watchdog.start()

    def _unmap(self) -> None:
        """Drops the device region (after our GPU is done with it), the words mapping, the mailbox."""
        if self._out_word and self._box is not None:
            self._release_all()
        self._unanswered.abandon()
        self._out_word = 0
        self._stream = None
        if self._gpu is not None:
            try:
                self._gpu.close()  # synchronises: no queued write of ours touches the words after
            except Exception:  # the executor may be gone; its memory goes with it
                pass
            self._gpu = None
        if self._words:
            try:
                self._box.unmap_words(self.area_device)
            except RuntimeError:
                pass
            self._words = 0
        if self._box is not None:
            self._box.close()
            self._box = None

    def _release_all(self, timeout_s: float = 60.0) -> None:
        """Lets every wait of our stream for the output word go, before the synchronise that
        drops the region: when calls are unanswered, or the executor is gone or has detached us,
        no result may come for them. Writes the word again while our stream still waits, since a
        write the executor's GPU had queued may land after ours and set it back."""
        box = self._box
        if not (self._unanswered.busy or box.detached or not alive(self._executor_pid)):
            return  # (every result is in or on its way)
        stream = torch.cuda.ExternalStream(self._stream, device=self._gpu.device) if self._stream else None
        deadline = time.monotonic() + timeout_s
        while True:
            if not reached(box.output_word(), self._seq):
                box.set_output_word(self._seq)
            if stream is None or stream.query() or time.monotonic() > deadline:
                return
            time.sleep(RELEASE_POLL_US * 1e-6)

    def _grow(self, need: int) -> None:
        if need > self._max_data:
            raise ResourceExhaustedError(
                f"call needs {need} bytes of mailbox, the executor at {self.url} allows at most {self._max_data} "
                "(split the batch, or start the executor with a larger --max-mailbox-mb)"
            )
        want = min(max(need, 2 * self._data_bytes), self._max_data)
        self._map(self.control("grow", pb.GrowRequest(data_bytes=want)).grow)

    def _call(self, request, x, out_shape, out_dtype, take=None):
        if self._box is None:
            raise NotAttachedError(f"not attached to {self.url}: call attach() first (or the tenant was detached)")
        if self._box.detached:
            self._detached()
        if self._gone:
            self._executor_gone(self._gone)
        if self._outstanding:  # an interrupted call is still running there: it is finished first
            self._finish_outstanding()
        if self._unanswered.busy:  # the replies that came; raises an earlier call's failure
            elsewhere = self._gpu is not None and x.device != self._gpu.device
            self._collect(keep=0 if elsewhere else None)  # (a copy from elsewhere may synchronise: nothing may block it)
        in_bytes = mailbox.align(x.numel() * x.element_size())
        need = in_bytes + codec.nbytes(out_shape, out_dtype)
        if need > self._data_bytes:
            self._collect(keep=0)  # the grown mailbox replaces this one: every call on it answered first
            self._grow(need)
        box, gpu = self._box, self._gpu
        request.in_offset, request.out_offset = 0, in_bytes
        area = gpu or box
        if gpu is not None:
            stream = _current_stream(gpu.device)  # after a copy from a peer GPU, too
            self._follow(stream)
        area.view(0, x.shape, x.dtype).copy_(x)
        early = False  # whether the call returns before its reply
        if gpu is not None:
            if self._words and x.device == gpu.device:
                self._seq = self._seq % 0xFFFFFFFF + 1  # never 0, which means "no word"
                stream_write(stream, self._words, self._seq)
                request.input_seq = self._seq
                early = bool(self._out_word) and self.return_early
            else:
                gpu.input_ready.record(torch.cuda.ExternalStream(stream, device=gpu.device))
        seq = request.input_seq if self._out_word else 0  # the output word tells when its result is in
        sent = tracked = False
        try:
            if not box.requests.push(request.SerializeToString()):
                raise InternalError("request ring full: another thread is using this tenant's transport without its lock")
            sent = True
            self._wake.ring(wake_always=True)
            if early:
                self._unanswered.add(Sent(request.call_id, seq, request.unit, request.op, tuple(out_shape), out_dtype))
                tracked = True  # (its reply and any release are the unanswered calls' now)
                stream_wait(stream, self._out_word, seq)  # our GPU waits for the result
        except BaseException:  # (an interrupt too) its word must still be written, in call order
            if not sent:
                self._release_failed(request.call_id, seq)
            elif not tracked:
                self._outstanding = (request.call_id, seq)  # the next call finishes it
            raise
        if early:
            y = gpu.view(request.out_offset, out_shape, out_dtype)
            result = y.clone() if take is None else take(y)  # (queued behind the wait)
            if len(self._unanswered) >= MAX_UNANSWERED:
                self._collect(keep=MAX_UNANSWERED // 2)
            return result
        try:
            reply = self._wait_reply(box, request.call_id)
        except BaseException:
            self._outstanding = (request.call_id, seq)  # its late result would land on the next call's bytes
            raise
        failure = reply_error(reply, call_name(request.unit, request.op), out_shape, out_dtype)
        if failure is not None:
            if reply.status.code != pb.OK:
                self._release_failed(request.call_id, seq)
            raise failure
        y = area.view(reply.out_offset, out_shape, out_dtype)
        if gpu is not None:  # our stream waits for the executor's writes; the host does not
            self._wait_result(stream, seq)
        if y.device != x.device:  # a fresh copy on the caller's device
            y = y.to(x.device) if gpu is None else torch.empty_like(y, device=x.device).copy_(y)
            return y if take is None else take(y)
        return y.clone() if take is None else take(y)  # in place in the mailbox: copied out

    def _follow(self, stream: int) -> None:
        """Orders a call made on another CUDA stream than the last call after that call: every
        call reuses the mailbox's bytes and words."""
        last = self._stream
        if last is not None and last != stream:
            if self._switched is None:
                self._switched = torch.cuda.Event()
            self._switched.record(torch.cuda.ExternalStream(last, device=self._gpu.device))
            torch.cuda.ExternalStream(stream, device=self._gpu.device).wait_event(self._switched)
        self._stream = stream

    def _finish_outstanding(self) -> None:
        """Waits for the reply of an interrupted call (before a grow replaces the rings it comes
        on), then orders our stream after its result: the next copy-in must not overwrite what
        its GEMM reads."""
        call_id, seq = self._outstanding
        reply = self._wait_reply(self._box, call_id)
        self._outstanding = None
        if reply.status.code != pb.OK:
            self._release_failed(call_id, seq)
        elif self._gpu is not None:
            self._wait_result(_current_stream(self._gpu.device), seq)

    def _release_failed(self, call_id: int, seq: int) -> None:
        """A call that waited for its reply failed, or was never sent: its output word is
        written in call order (client/transports/unanswered.py); nobody else writes it."""
        if seq:
            self._unanswered.add_failed(Sent(call_id, seq, "", pb.FORWARD, (), torch.float32))
            self._collect(keep=len(self._unanswered))

    def _wait_result(self, stream: int, seq: int) -> None:
        """Our stream waits for the executor's writes of an answered call: for its output word
        to reach `seq`, or (0) for output_ready."""
        if seq:
            stream_wait(stream, self._out_word, seq)
        else:
            torch.cuda.ExternalStream(stream, device=self._gpu.device).wait_event(self._gpu.output_ready)

    def _wait_reply(self, box: mailbox.Mailbox, call_id: int) -> pb.CallReply:
        u = self._unanswered
        while True:
            seq = box.reply_bell.seq()
            raw = box.replies.pop()
            if raw is not None:
                reply = pb.CallReply.FromString(raw)
                if reply.call_id == call_id or (reply.call_id == 0 and not u):
                    return reply
                u.answer(reply)  # an earlier call's (else a stale reply of an abandoned call)
                continue
            u.release(box)  # (a failed earlier call's wait may hold this call's input back)
            self._sleep(box, seq, RELEASE_POLL_US if u.failed else LIVENESS_SLICE_US)

    def _sleep(self, box: mailbox.Mailbox, seq: int, timeout_us: int) -> None:
        """Waits for a reply after the bell's `seq`, at most timeout_us; raises when the executor
        detached us or died."""
        if box.detached:
            self._detached()
        if box.reply_bell.wait(seq, self._spin, timeout_us) == seq and not alive(self._executor_pid):
            self._executor_gone(f"the executor at {self.url} (pid {self._executor_pid}) died during a call")

    def _executor_gone(self, why: str):
        self.tenant_id = 0
        self._teardown()
        raise ExecutorUnavailableError(why)

    def _collect(self, keep: int | None = None) -> None:
        """Takes the replies of calls that returned early (Unanswered.collect)."""
        self._unanswered.collect(self._box, self._sleep, keep)

    def _confirm(self) -> None:
        if self._gone and self._box is not None:
            self._executor_gone(self._gone)
        if self._outstanding and self._box is not None:  # (its reply is not one of the unanswered)
            self._finish_outstanding()
        if self._box is not None and self._unanswered.busy:
            self._collect(keep=0)

    def _detached(self):
        self.tenant_id = 0
        self._teardown()
        raise NotAttachedError(
            f"the executor at {self.url} detached this tenant (its process was seen dead, it corrupted its ring, "
            "or it left replies unread); connect again"
        )

    def _teardown(self) -> None:
        self._unmap()
        self._wake = None
        if self._wake_mem is not None:
            try:
                self._wake_mem.close()
            except BufferError:
                pass
            self._wake_mem = None
        if self.tenant_id == 0:
            self._channel.close()
            self._executor_pid = self._channel.executor_pid = 0  # (a restarted executor has another)


def _current_stream(device: torch.device) -> int:
    """The cudaStream_t of `device`'s current stream (0.4 µs of host time against 5.8-7.6 µs for
    torch.cuda.current_stream: benchmarks/RESULTS.md, S6 pieces)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def _watch(ref) -> None:
    """Watchdog of one transport: while calls are unanswered and the caller is not in one (its host
    may be blocked in a CUDA synchronise behind our GPU's waits), takes their replies, releases
    failed calls, and releases every wait once the executor is gone or has detached us. Runs until
    the transport is closed (a grow unmaps the mailbox for a moment)."""
    while True:
        time.sleep(WATCH_S)
        t = ref()
        if t is None or (t.tenant_id == 0 and t._box is None):
            return
        if t._out_word and t._lock.acquire(blocking=False):
            try:
                box = t._box
                if box is not None and t._out_word and not reached(box.output_word(), t._seq):  # a wait of ours may hang
                    if t._outstanding is None:  # (else its reply is the caller's)
                        try:
                            t._unanswered.take(box)
                        except Exception:  # (a corrupt ring: the caller's next call meets it)
                            pass
                    if box.detached or not alive(t._executor_pid):
                        box.set_output_word(t._seq)  # no result comes any more
                        t._gone = f"the executor at {t.url} (pid {t._executor_pid}) is gone, or detached this tenant"
            finally:
                t._lock.release()
        del t
