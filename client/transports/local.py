"""Same-host transport (`local://NAME`), tenant side: ZeroMQ for control, the csrc rings and
doorbells for signalling, and the executor's mailbox for tensors: host shared memory, or, when
the tenant sits on the executor's GPU or on a peer GPU of the same host, device memory on the
executor's GPU opened by CUDA IPC handle (the copy-in — a peer copy from another GPU — the
executor's GEMM and the read are ordered by interprocess events; no host synchronisation)."""
from __future__ import annotations

import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from client.errors import (
    ExecutorUnavailableError,
    InternalError,
    MalformedMessageError,
    NotAttachedError,
    ResourceExhaustedError,
    raise_for_status,
)
from client.transport import Transport
from proto import codec, mailbox, urls
from proto.cuda_ipc import stream_write
from proto.procs import alive
from proto import executor_pb2 as pb
from proto._doorbell import Doorbell

SPIN_US = 20  # a CPU tenant: its executor shares the cores, spinning would slow the GEMMs
GPU_SPIN_US = 200  # a tenant whose data area is on a GPU: a reply takes ~0.2 ms (S6), sleeping costs more
LIVENESS_SLICE_US = 200_000
CONTROL_SLICE_S = 0.2


class LocalTransport(Transport):
    def __init__(self, url: str, name: str):
        super().__init__(url)
        self.endpoint = urls.control_endpoint(name)
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._executor_pid = 0
        self._wake_mem = self._wake = None
        self._box: mailbox.Mailbox | None = None
        self._gpu = None  # proto.cuda_ipc.OpenedRegion when the data area is on our GPU
        self._words = 0  # device address of the mailbox's input word, when our GPU writes it
        self._seq = 0  # the last input_seq written there
        self._max_data = 0
        self.spin_us: int | None = None  # how long a call spins on its reply before sleeping (None: by placement)
        self._spin = SPIN_US
        self._outstanding = 0  # call id of an interrupted call whose reply has not come yet
        self._control_lock = threading.Lock()  # the DEALER socket is not thread-safe

    def _socket(self):
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        return self._sock

    def _control(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        with self._control_lock:
            return self._control_locked(request, timeout_s)

    def _control_locked(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        sock = self._socket()
        sock.send(request.SerializeToString())
        deadline = time.monotonic() + timeout_s
        answered = False
        while not answered and time.monotonic() < deadline:
            answered = bool(sock.poll(int(min(CONTROL_SLICE_S, max(deadline - time.monotonic(), 0)) * 1000)))
            if not answered and self._executor_pid and not alive(self._executor_pid):
                break
        if not answered:
            # a DEALER would deliver the late reply to the next request: start over with a new socket
            sock.close()
            self._sock = None
            if self._executor_pid and not alive(self._executor_pid):
                raise ExecutorUnavailableError(f"the executor at {self.url} (pid {self._executor_pid}) is gone")
            raise ExecutorUnavailableError(
                f"no executor answered at {self.url} within {timeout_s:.0f} s (is `base-executor serve --listen {self.url}` running?)"
            )
        try:
            return pb.ControlReply.FromString(sock.recv())
        except DecodeError as e:
            raise MalformedMessageError(f"reply from {self.url} does not parse: {e}") from e

    def _attached(self, reply: pb.AttachReply) -> None:
        if (reply.ring_slots, reply.ring_slot_size, reply.data_offset) != (
            mailbox.RING_SLOTS, mailbox.RING_SLOT_SIZE, mailbox.DATA_OFFSET
        ):
            raise InternalError("the executor uses another mailbox layout: install the same symbiont version on both sides")
        self._executor_pid = reply.wake.owner_pid
        self._wake_mem = mailbox.open_region(reply.wake.owner_pid, reply.wake.fd, reply.wake.size)
        self._wake = Doorbell(self._wake_mem, 0)
        self._map(reply)
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
                self._map_words()

    def _map_words(self) -> None:
        """Lets our GPU write the mailbox's input word (a call's input_seq, once its copy is done),
        which the executor's GPU waits on; without it, calls record the input_ready event."""
        self._seq = 0  # a new mailbox's word starts at 0
        try:
            self._words = self._box.map_input_word(self.area_device)
        except RuntimeError:
            self._words = 0

    def _unmap(self) -> None:
        """Drops the device region (after our GPU is done with it), the words mapping, the mailbox."""
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
        if self._outstanding:  # an interrupted call is still running there: let it finish first
            self._wait_reply(self._box, self._outstanding)  # before a grow replaces the rings its reply comes on
            self._outstanding = 0
            if self._gpu is not None:  # and our next copy-in must not overwrite what its GEMM reads
                torch.cuda.current_stream(self._gpu.device).wait_event(self._gpu.output_ready)
        in_bytes = mailbox.align(x.numel() * x.element_size())
        need = in_bytes + codec.nbytes(out_shape, out_dtype)
        if need > self._data_bytes:
            self._grow(need)
        box, gpu = self._box, self._gpu
        request.in_offset, request.out_offset = 0, in_bytes
        area = gpu or box
        area.view(0, x.shape, x.dtype).copy_(x)
        if gpu is not None:
            stream = torch.cuda.current_stream(gpu.device)  # after a copy from a peer GPU, too
            if self._words and x.device == gpu.device:
                self._seq = self._seq % 0xFFFFFFFF + 1  # never 0, which means "no word"
                stream_write(stream.cuda_stream, self._words, self._seq)
                request.input_seq = self._seq
            else:
                gpu.input_ready.record(stream)
        if not box.requests.push(request.SerializeToString()):
            raise InternalError("request ring full: another thread is using this tenant's transport without its lock")
        self._wake.ring(wake_always=True)
        try:
            reply = self._wait_reply(box, request.call_id)
        except BaseException:
            self._outstanding = request.call_id  # its late result would land on the next call's bytes
            raise
        self._outstanding = 0
        raise_for_status(reply.status, f"{_op_name(request.op)} of {request.unit!r}")
        if tuple(reply.shape) != tuple(out_shape) or codec.TORCH_OF.get(reply.dtype) is not out_dtype:
            raise InternalError(f"executor returned {list(reply.shape)} {reply.dtype}, expected {list(out_shape)} {out_dtype}")
        y = area.view(reply.out_offset, out_shape, out_dtype)
        if gpu is not None:  # our stream waits for the executor's writes; the host does not
            stream.wait_event(gpu.output_ready)
        if y.device != x.device:  # a fresh copy on the caller's device
            y = y.to(x.device) if gpu is None else torch.empty_like(y, device=x.device).copy_(y)
            return y if take is None else take(y)
        return y.clone() if take is None else take(y)  # in place in the mailbox: copied out

    def _wait_reply(self, box: mailbox.Mailbox, call_id: int) -> pb.CallReply:
        while True:
            seq = box.reply_bell.seq()
            raw = box.replies.pop()
            if raw is not None:
                reply = pb.CallReply.FromString(raw)
                if reply.call_id in (call_id, 0):
                    return reply
                continue  # a stale reply of an abandoned call
            if box.detached:
                self._detached()
            if box.reply_bell.wait(seq, self._spin, LIVENESS_SLICE_US) == seq and not alive(self._executor_pid):
                self.tenant_id = 0
                self._teardown()
                raise ExecutorUnavailableError(f"the executor at {self.url} (pid {self._executor_pid}) died during a call")

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
        if self._sock is not None and self.tenant_id == 0:
            self._sock.close()
            self._sock = None


def _op_name(op: int) -> str:
    return pb.Op.Name(op) if op in pb.Op.values() else f"op {op}"
