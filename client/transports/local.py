"""Same-host transport (`local://NAME`), tenant side: ZeroMQ for control, the csrc rings and
doorbells for signalling, and the executor's mailbox for tensors: host shared memory, or, when
the tenant sits on the executor's GPU or on a peer GPU of the same host, device memory on the
executor's GPU opened by CUDA IPC handle (the copy-in — a peer copy from another GPU — the
executor's GEMM and the read are ordered on the GPUs; no host synchronisation).

On the executor's own GPU a call returns as soon as it is sent, its result ordered behind a GPU
wait for the mailbox's output word (client/transports/words.py); its reply is taken later
(client/transports/unanswered.py), at the latest by confirm(), which virtualize() runs at the
end of every forward and backward pass; where it can, such a call is one native call
(client/transports/local_calls.py, which also keeps the plans every call of one unit and shape
shares). Elsewhere (peer GPU, host mailbox, words that cannot be mapped) a call waits for its
reply.

Only a process's one tenant of an executor returns early. With two on one executor (each its
own connection, its calls on a thread and stream of its own, say), a call returned early
leaves a GPU wait on our side before the executor has queued anything for it; another tenant's
input copy queued behind that wait on a hardware queue our streams share, and the first tenant's
result queued behind the executor's wait for that input on a queue its streams share, wait for
each other for ever (64 tenants as 16 processes of 4 on an H100 and an H200, session 44). A call
that waits for its reply first queues its GPU wait only after the executor queued its result, so
no such cycle forms. A tenant that joins one already calling first waits, on the host, until the
GPU waits the other queued while alone have passed (its calls from then on wait for their replies),
a call of the other's between its look at `_early` and its GPU wait included (`_deciding`).
"""
from __future__ import annotations

import math
import threading
import time
import warnings
import weakref

import torch
from symbiont.client.errors import (
    ExecutorUnavailableError,
    InternalError,
    NotAttachedError,
    ResourceExhaustedError,
    SymbiontError,
)
from symbiont.client.transport import Transport
from symbiont.client.transports.control import ControlChannel
from symbiont.client.transports.ids import IdsChecks
from symbiont.client.transports.local_calls import MAX_UNANSWERED, LocalCalls, Plan, native_lane
from symbiont.client.transports.local_programs import LocalPrograms
from symbiont.client.transports.unanswered import RELEASE_POLL_US, Sent, Unanswered, reply_error
from symbiont.client.transports.words import StreamOrder, start_watchdog
from symbiont.proto import codec, mailbox, urls
from symbiont.proto.cuda_ipc import reached
from symbiont.proto.procs import alive
from symbiont.proto import executor_pb2 as pb
from symbiont.proto._doorbell import Doorbell

# this process's transports whose GPU waits on an output word: id -> weak reference (under the lock)
_WAITERS: "dict[int, weakref.ref[LocalTransport]]" = {}
_WAITERS_LOCK = threading.Lock()
SETTLE_S = 30.0  # how long a new tenant waits for its siblings' GPU waits queued while they were alone
SPIN_US = 20  # a CPU tenant: its executor shares the cores, spinning would slow the GEMMs
GPU_SPIN_US = 200  # a tenant whose data area is on a GPU: a reply takes ~0.2 ms (S6), sleeping costs more
# A call that needs a bigger mailbox than this is made in chunks of rows that fit, not by growing
# the mailbox to it: every unit is row-wise (a token's output depends on that token's input only).
# A llama-1b training step's logits (2 x 512 tokens x 128256) would otherwise keep a 271 MiB
# mailbox per tenant on the executor (benchmarks/RESULTS.md, "Memory per tenant").
SPLIT_BYTES = 64 << 20


class LocalTransport(LocalCalls, LocalPrograms, Transport):
    def __init__(self, url: str, name: str):
        super().__init__(url)
        self._channel = ControlChannel(url, urls.control_endpoint(name))
        self._executor_pid = 0
        self._wake_mem = self._wake = None
        self._box: mailbox.Mailbox | None = None
        self._order: StreamOrder | None = None  # when the data area is on our GPU
        self._unanswered = Unanswered()  # calls returned before their replies (same GPU)
        self._gone = ""  # why the watchdog found the executor gone or us detached
        self._watchdog = None  # its thread, once a mailbox had an output word
        self._max_data = 0
        self.split_bytes = SPLIT_BYTES  # calls needing more mailbox than this go in chunks of rows (0: never)
        # same GPU: whether a call returns before its reply (True) or waits for it (False); None:
        # it does while no other tenant of this process is attached to the same executor (_early)
        self.return_early: bool | None = None
        self.spin_us: int | None = None  # how long a call spins on its reply before sleeping (None: by placement)
        self._spin = SPIN_US
        self._outstanding: tuple[int, int] | None = None  # (call id, input_seq) of an interrupted call not answered yet
        self._deciding = False  # a call is between its look at _early() and its GPU wait (_call)
        self._settled = False  # this attach's first join waited out its siblings' early calls (_join_waiters)
        self.native_calls = True  # same GPU: a call's steps in one native call where it can (False: each from Python)
        # a peer GPU of the executor's: calls ordered on our streams by the mailbox's words, as on its GPU
        # (False, set before attaching: on its GPU by the mailbox's events, each call waiting for its reply)
        self.peer_streams = True
        self._lane = None  # proto._stream_ops.Lane of the mailbox, when its calls can take the native path
        self._plans: dict[tuple, Plan] = {}  # of the mailbox
        self._failures = 0  # the mailbox's count of failure replies when replies were last taken
        self._id_checks = IdsChecks()  # of the embedding ids sent to a data area on a GPU
        self._recording: list[bytes] | None = None  # a step program's calls while a capture records them
        self._recording_box = None  # the mailbox they were recorded on
        self._recorder = 0  # the thread whose calls are recorded (another thread's calls go as ever)
        self._programs_broken = False  # a step's replay failed mid-run: no step programs on this transport any more
        self._program_headers: dict[int, tuple] = {}  # program id -> (its mailbox, its run's request header)

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
        self._max_data = reply.max_mailbox_bytes
        self._map(reply)  # (releases what an earlier mailbox still waited for)

    def _executor_alive(self) -> bool:
        return alive(self._executor_pid)

    def _map(self, reply: pb.AttachReply | pb.GrowReply) -> None:
        """Maps the mailbox (and device region) an attach or grow reply names, dropping the old."""
        self._unmap(grow=True)
        on_gpu = reply.HasField("cuda")
        region = reply.mailbox
        box = mailbox.Mailbox(mailbox.open_region(region.owner_pid, region.fd, region.size), 0 if on_gpu else reply.data_bytes)
        self._data_bytes = reply.data_bytes
        self._spin = self.spin_us if self.spin_us is not None else (GPU_SPIN_US if on_gpu else SPIN_US)
        order = None
        if on_gpu:
            from symbiont.proto.cuda_ipc import OpenedRegion, enable_peer_access

            c = reply.cuda
            own = c.input_word and (self.peer_streams or self.device == self.area_device)
            if own and self.device != self.area_device:  # our streams copy to and from it
                try:
                    enable_peer_access(self.device, self.area_device)
                except RuntimeError as e:  # (copies still arrive, through the host)
                    warnings.warn(f"{self.url}: no peer access from {self.device} to {self.area_device} ({e}); "
                                  "copies to the executor's GPU go through the host", RuntimeWarning, stacklevel=2)
            region = OpenedRegion.open(self.area_device, c.size, c.mem_handle, c.input_ready, c.output_ready)
            order = StreamOrder(region, self.device if own else region.device)
            if c.input_word:
                order.map_words(box, c.output_word, self.url)
                if (c.words_offset and order.words and c.words_offset % mailbox.ALIGN == 0
                        and c.words_offset + mailbox.DEVICE_WORDS_BYTES <= c.size):  # (serve --device-words)
                    order.device_words = region.ptr + c.words_offset
        self._box, self._order = box, order
        self._plans, self._failures, self._program_headers = {}, 0, {}
        self._programs_broken = False  # (a new mailbox's program words start at 0)
        self._unanswered.bind(box, order)
        self._lane = native_lane(box, order, self._wake_mem, self.url) if order is not None and order.out_word else None
        if not (order is not None and order.out_word):  # (a grow whose words could not be mapped)
            with _WAITERS_LOCK:
                _WAITERS.pop(id(self), None)
        else:
            self._settle()

    def _settle(self) -> None:
        """Joins the process's waiters (_join_waiters) and starts the watchdog of our GPU's waits:
        at a mapping with words, and at the next call when an interrupt cut that short."""
        self._join_waiters()
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = start_watchdog(self)

    def _unmap(self, grow: bool = False) -> None:
        """Drops the device region (after our GPU is done with it), the words mapping, the mailbox;
        stays among the process's waiters when a grow maps the next (_map)."""
        box, order = self._box, self._order
        if not grow:
            with _WAITERS_LOCK:
                _WAITERS.pop(id(self), None)
            self._settled = False
        if order is not None and order.out_word and box is not None:
            if self._unanswered.busy or box.detached or not self._executor_alive():
                order.release_all(self._unanswered)  # no result may come for the calls our GPU waits for
        self._unanswered.bind(None)  # (the watchdog no longer touches the mailbox)
        self._order, self._lane, self._plans = None, None, {}  # (the lane holds the mailbox's and wake word's buffers)
        if order is not None:
            order.close(box)
        if box is not None:
            box.close()
            self._box = None

    def _early(self) -> bool:
        """Whether a call may return before its reply: return_early when set, else while no other
        transport of this process whose GPU waits on an output word is attached to our executor
        (the module's docstring says why; a sharded executor's ranks are other processes)."""
        if self.return_early is not None:
            return self.return_early
        if len(_WAITERS) < 2:
            return True
        return not self._siblings()

    def _siblings(self) -> list:
        """The process's other transports whose GPU waits on an output word, attached to our executor."""
        with _WAITERS_LOCK:
            for key in [k for k, r in _WAITERS.items() if r() is None]:  # (collected without closing)
                del _WAITERS[key]
            others = [r() for r in _WAITERS.values()]
        pid = self._executor_pid
        return [t for t in others if t is not None and t is not self and t._executor_pid == pid
                and ((box := t._box) is None or not box.detached)]  # (None: between a grow's two mailboxes)

    def _join_waiters(self) -> None:
        """Counts this transport among the process's waiters (a grow's remap: still counted). A
        first join beside siblings waits until the GPU waits they queued while alone have passed:
        their calls wait for their replies from now on (_early), ours too. A join cut short (an
        interrupt) stays counted, and our next call joins again (_call)."""
        with _WAITERS_LOCK:
            ref = _WAITERS.get(id(self))
            known = ref is not None and ref() is self
            _WAITERS[id(self)] = weakref.ref(self)
        if known and self._settled:
            return
        deadline = time.monotonic() + SETTLE_S
        for t in self._siblings():
            box, order = t._box, t._order
            if box is None or order is None:
                continue
            seq = None  # the sibling's last call that may have looked at _early() before we joined
            while t._box is box and not box.detached and time.monotonic() < deadline:  # (a grow's new mailbox: its words start over)
                if seq is None and not t._deciding:  # (read once: its later calls see us and wait for their replies)
                    seq = order.seq
                if seq is not None and reached(box.output_word(), seq):
                    break
                time.sleep(RELEASE_POLL_US * 1e-6)
            else:
                if time.monotonic() >= deadline and t._box is box and not box.detached:
                    warnings.warn(f"{self.url}: joined after {SETTLE_S:.0f} s without seeing a sibling tenant's early calls "
                                  "answered", RuntimeWarning, stacklevel=3)
        self._settled = True

    def _grow(self, need: int) -> None:
        if need > self._max_data:
            raise ResourceExhaustedError(
                f"call needs {need} bytes of mailbox, the executor at {self.url} allows at most {self._max_data} "
                "(split the batch, or start the executor with a larger --max-mailbox-mb)"
            )
        double = 2 * self._data_bytes if not self.split_bytes else min(2 * self._data_bytes, self.split_bytes)
        want = min(max(need, double), self._max_data)
        self._map(self.control("grow", pb.GrowRequest(data_bytes=want)).grow)

    def _rows_per_chunk(self, x: torch.Tensor, out_shape: tuple[int, ...], out_dtype: torch.dtype) -> int:
        """How many rows (the leading dims x and the result share) each chunk of a call takes when
        the call needs more mailbox than we have and more than split_bytes; 0: one whole call."""
        in_bytes, out_bytes = x.numel() * x.element_size(), codec.nbytes(out_shape, out_dtype)
        lead = out_shape[:-1]
        rows = math.prod(lead)
        if (not self.split_bytes or mailbox.align(in_bytes) + out_bytes <= max(self._data_bytes, self.split_bytes)
                or rows < 2 or tuple(x.shape[: len(lead)]) != lead):
            return 0
        per_row = -(-(in_bytes + out_bytes) // rows)
        return max(1, (self.split_bytes - mailbox.align(1)) // per_row)

    def _call_in_rows(self, unit, op, x, out_shape, out_dtype, latency, take, chunk: int):
        """One call as calls of `chunk` rows each, every result copied into its rows of one output."""
        lead = out_shape[:-1]
        rows = math.prod(lead)
        xs = x.reshape(rows, *x.shape[len(lead):])
        y = torch.empty((rows, out_shape[-1]), dtype=out_dtype, device=x.device)
        for i in range(0, rows, chunk):
            part = y[i : i + chunk]
            self._call(unit, op, xs[i : i + chunk], tuple(part.shape), out_dtype, latency, take=part.copy_)
        y = y.view(out_shape)
        return y if take is None else take(y)

    def _call(self, unit, op, x, out_shape, out_dtype, latency, take=None):
        if self._recording is not None and threading.get_ident() == self._recorder:  # (a capture: nothing may wait on the host)
            return self._record(unit, op, x, out_shape, out_dtype, latency, take)
        self._call_checks()
        if self._order is not None and x.device == self._order.device and torch._C._cuda_getDevice() != x.device.index:
            with torch.cuda.device(x.device):  # raw stream handles (0: the default stream) are the current device's
                return self._call(unit, op, x, out_shape, out_dtype, latency, take)
        # from the look at _early() until the call's GPU wait is queued (or its reply taken): a sibling
        # joining meanwhile either is seen by the look or waits for this call's output word (_join_waiters)
        self._deciding = True
        try:
            return self._call_decided(unit, op, x, out_shape, out_dtype, latency, take)
        finally:
            self._deciding = False

    def _call_checks(self) -> None:
        """Before a call: raises when we are not attached, detached or the executor is gone;
        finishes an interrupted call, and a join an interrupt cut short."""
        if self._box is None:
            if self._gone:  # (every call after the executor was found gone says so, not only the first)
                raise ExecutorUnavailableError(self._gone)
            raise NotAttachedError(f"not attached to {self.url}: call attach() first (or the tenant was detached)")
        if self._box.detached:
            self._detached()
        if self._gone:
            self._executor_gone(self._gone)
        if self._outstanding:  # an interrupted call is still running there: it is finished first
            self._finish_outstanding()
        if not self._settled and self._order is not None and self._order.out_word:  # (the attach's join was cut short)
            self._settle()

    def _call_decided(self, unit, op, x, out_shape, out_dtype, latency, take):
        unanswered, box = self._unanswered, self._box
        may_return, native = self._decide(x)
        if native:  # replies are taken every TAKE_EVERY calls, and at once when one says a call failed
            failures = self._box.failures()
            if failures != self._failures or unanswered.failure is not None or unanswered.failed:
                self._failures = failures
                self._collect()
        elif unanswered.busy:  # the replies that came; raises an earlier call's failure
            elsewhere = self._order is not None and x.device != self._order.device
            self._collect(keep=0 if elsewhere else None)  # (a copy from elsewhere may synchronise: nothing may block it)
        if self._id_checks.pending:
            self._id_checks.raise_done()  # an earlier call's ids, when their bounds are in
        key = (unit, op, x.shape, x.dtype, latency, out_shape, out_dtype)
        plan = self._plans.get(key)
        if plan is None:
            chunk = self._rows_per_chunk(x, out_shape, out_dtype)
            if chunk:
                return self._call_in_rows(unit, op, x, out_shape, out_dtype, latency, take, chunk)
            plan = self._plan(key, x)  # (a grow maps another mailbox)
            if self._box is not box and may_return:  # (a sibling joining meanwhile did not see this call: look again)
                may_return, native = self._decide(x)
        call_id = next(self._ids)
        if x.dtype == torch.int64 and self._order is not None:  # embedding ids into our GPU data area
            if x.is_cuda:  # (queued first: the copy of the bounds runs while the call goes)
                self._id_checks.queue(self.embedding_rows, unit, x, call_id)
            else:
                self._id_checks.check_now(self.embedding_rows, unit, x)
        try:
            return self._send_call(unit, op, x, out_shape, out_dtype, latency, take, plan, key, call_id, native, may_return)
        except BaseException:  # (its failure, or another's: the forward ends with it)
            self._id_checks.forget(call_id)
            raise

    def _decide(self, x: torch.Tensor) -> tuple[bool, bool]:
        """Whether the call on x may return before its reply, and whether it goes natively. A call
        that may not is no longer deciding (a joining sibling need not wait for it)."""
        may_return = self._order is not None and self._early()  # (looked at once a call: it walks the siblings)
        if not may_return:
            self._deciding = False
        return may_return, self._lane is not None and self.native_calls and may_return and x.device == self._order.device

    def _send_call(self, unit, op, x, out_shape, out_dtype, latency, take, plan, key, call_id: int, native: bool,
                   may_return: bool):
        if native and self._lane is not None:
            return self._send(x, plan, key, take, call_id)
        x = x.detach().contiguous()
        request = self._request(unit, op, x, latency, call_id)
        in_bytes = mailbox.align(plan.in_nbytes)
        box, order = self._box, self._order
        request.in_offset, request.out_offset = 0, in_bytes
        area = order.region if order is not None else box
        direct = order is not None and x.device == order.device  # (else a copy from the host or a peer GPU)
        if order is not None:
            stream = order.current_stream()  # after a copy from a peer GPU, too
            order.follow(stream)
        if direct:
            order.copy_in(x, stream)
        else:
            area.view(0, x.shape, x.dtype).copy_(x)
        early = False  # whether the call returns before its reply
        if order is not None:
            request.input_seq = order.input_in(stream, word=direct)  # (a peer GPU's streams cannot write our words)
            early = bool(request.input_seq and order.out_word) and may_return
        seq = request.input_seq if order is not None and order.out_word else 0  # the output word tells when its result is in
        sent = False
        try:
            # whoever takes the reply is known before the request goes: the watchdog may take it
            # at once, and keeps only the replies of calls it knows
            if early:
                self._unanswered.add(Sent(request.call_id, seq, request.unit, request.op, tuple(out_shape), out_dtype))
            else:
                self._unanswered.await_reply(request.call_id)
            if not box.requests.push(request.SerializeToString()):
                raise InternalError("request ring full: another thread is using this tenant's transport without its lock")
            sent = True
            self._wake.ring(wake_always=True)
            if early:
                order.wait_result(stream, seq)  # our GPU waits for the result
                self._deciding = False  # (its wait is queued: a joining sibling reads its sequence now)
        except BaseException:  # (an interrupt too) its word must still be written, in call order
            if not sent:
                self._unanswered.forget(request.call_id)
                self._release_failed(request.call_id, seq)
            elif not early:  # (an early call's reply and any release are the unanswered calls')
                self._set_outstanding(request.call_id, seq)  # the next call finishes it
            raise
        if early:  # (the copy out is queued behind the wait)
            result = self._take(plan.out, stream, take)
            if len(self._unanswered) >= MAX_UNANSWERED:
                self._collect(keep=MAX_UNANSWERED // 2)
            return result
        try:
            reply = self._unanswered.wait_reply(request.call_id, self._sleep)
        except BaseException:
            self._set_outstanding(request.call_id, seq)  # its late result would land on the next call's bytes
            raise
        failure = reply_error(reply, request.unit, request.op, out_shape, out_dtype)
        if failure is not None:
            if reply.status.code != pb.OK:
                self._release_failed(request.call_id, seq)
            raise failure
        y = area.view(reply.out_offset, out_shape, out_dtype)
        if order is not None:  # our stream waits for the executor's writes; the host does not
            order.wait_result(stream, seq)
        if self._id_checks.pending:  # a call that waits for its reply: its ids' failure too
            self._id_checks.raise_done(wait=True)
        if direct:
            return self._take(y, stream, take)
        if y.device != x.device:  # a fresh copy on the caller's device
            y = y.to(x.device) if order is None else torch.empty_like(y, device=x.device).copy_(y)
            return y if take is None else take(y)
        return y.clone() if take is None else take(y)  # in place in the mailbox: copied out

    def _set_outstanding(self, call_id: int, seq: int) -> None:
        """A call was sent but its reply is not taken: the next call (or confirm) finishes it."""
        self._outstanding = (call_id, seq)
        self._unanswered.await_reply(call_id)  # (kept for us when the watchdog takes it)

    def _finish_outstanding(self) -> None:
        """Waits for the reply of an interrupted call (before a grow replaces the rings it comes
        on), then orders our stream after its result: the next copy-in must not overwrite what
        its GEMM reads."""
        call_id, seq = self._outstanding
        reply = self._unanswered.wait_reply(call_id, self._sleep)
        self._outstanding = None
        if reply.status.code != pb.OK:
            self._release_failed(call_id, seq)
        elif self._order is not None:
            self._order.wait_result(self._order.current_stream(), seq)

    def _release_failed(self, call_id: int, seq: int) -> None:
        """A call that waited for its reply failed, or was never sent: its output word is
        written in call order (client/transports/unanswered.py); nobody else writes it."""
        if seq:
            self._unanswered.add_failed(Sent(call_id, seq, "", pb.FORWARD, (), torch.float32))
            self._collect(keep=len(self._unanswered))

    def _sleep(self, box: mailbox.Mailbox, seq: int, timeout_us: int) -> None:
        """Waits for a reply after the bell's `seq`, at most timeout_us; raises when the executor
        detached us or died."""
        if box.detached:
            self._detached()
        if box.reply_bell.wait(seq, self._spin, timeout_us) == seq and not self._executor_alive():
            self._executor_gone(f"the executor at {self.url} (pid {self._executor_pid}) died during a call")

    def _executor_gone(self, why: str):
        self._gone = why
        self.tenant_id = 0
        self._teardown()
        raise ExecutorUnavailableError(why)

    def _collect(self, keep: int | None = None) -> None:
        """Takes the replies of calls that returned early (Unanswered.collect)."""
        try:
            self._unanswered.collect(self._sleep, keep)
        except SymbiontError as e:  # a failed call's ids check goes with it
            if getattr(e, "call_id", 0):
                self._id_checks.forget(e.call_id)
            raise

    def _confirm(self) -> None:
        if self._recording is not None and threading.get_ident() == self._recorder:  # (within a capture: nothing was sent)
            return
        if self._gone and self._box is not None:
            self._executor_gone(self._gone)
        if self._outstanding and self._box is not None:  # (its reply is not one of the unanswered)
            self._finish_outstanding()
        if self._box is not None and self._unanswered.busy:
            self._collect(keep=0)
        if self._id_checks.pending:
            self._id_checks.raise_done(wait=True)

    def _detached(self):
        if not self._executor_alive():
            self._executor_gone(f"the executor at {self.url} (pid {self._executor_pid}) has stopped")
        self.tenant_id = 0
        self._teardown()
        raise NotAttachedError(
            f"the executor at {self.url} detached this tenant (its process was seen dead, it corrupted its ring, "
            "it left replies unread, or the executor is stopping); connect again"
        )

    def _teardown(self) -> None:
        self._unmap()
        self._id_checks.clear()
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
