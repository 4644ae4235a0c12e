"""Same-host transport server (`local://NAME`): ZeroMQ control on a unix socket, tensors in
executor-owned per-tenant shared-memory mailboxes, signalling through the csrc doorbell rings.

A tenant on the executor's own GPU gets its data area in device memory instead (proto/cuda_ipc.py),
shared once by CUDA IPC handle; the rings and doorbells stay in host shared memory. Its stream
writes a call's input_seq to the mailbox's input word once the input is in; ours writes it to
the output word once the result is in, and the tenant's GPU waits for that, so no host waits
for the other's GPU work and the tenant's call returns before our reply. Such a call is taken
when its input word says the copy is done, or at once (a lone tenant) with its GEMM queued on a
stream of the tenant's own behind a GPU wait for the word: no tenant can stall our main stream
behind a kernel that never ends. Where the words cannot be mapped, interprocess events order
the work instead. A tenant on another GPU of the host that can reach
ours as a peer maps the same device mailbox and copies in and out over the peer link. A host
mailbox of a GPU executor is page-locked, so its copies are DMA.

Two threads: the control thread answers ControlRequests (local_control.py); the data loop
waits on the executor-wide wake word, drains every tenant's request ring into the core, steps
the core, writes results into mailboxes and rings each tenant's reply doorbell. Nothing here blocks on a tenant: a tenant that dies, corrupts
its ring or never reads its replies is detached and its mailbox reclaimed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from base_executor.core import CallError, ExecutorCore, Result
from base_executor.scheduler import Call
from base_executor.transports.areas import AreaPool, Tenant, owner_alive
from base_executor.transports.local_control import LocalControl
from proto import codec, mailbox, urls
from proto.cuda_ipc import reached, stream_wait, stream_write
from proto import executor_pb2 as pb
from proto._doorbell import Doorbell

log = logging.getLogger("base_executor")

HELD_POLL_S = 5e-6  # how soon a held call's input copy is looked at again


@dataclasses.dataclass(slots=True, eq=False)
class Delivery:
    """Where a call's result goes (its Call.tag)."""

    tenant: Tenant
    area: object  # the tenant's data area when the call was taken (a grow retires it)
    out_offset: int
    input_seq: int  # written to the mailbox's output word once the result is in place (0: none)
    stream: object = None  # the stream that runs the call; None: the data loop's


@dataclasses.dataclass(slots=True, eq=False)
class _Told:
    """One tenant's replies of a delivery, and how its GPU learns that their results are in."""

    stream: object  # the stream that wrote the results
    seq: int = 0  # the latest input_seq among the calls: written to the output word
    event: bool = False  # some call had no input_seq: output_ready is recorded
    replies: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalServerConfig:
    name: str
    """The NAME of local://NAME."""
    mailbox_bytes: int = 16 << 20
    """Initial data area of a tenant's mailbox."""
    max_mailbox_bytes: int = 1 << 30
    """The most a tenant's data area may grow to; a call needing more is refused."""
    max_tenants: int = 256
    """Attach requests beyond this many tenants are refused."""
    spin_us: int = 20
    """How long the data loop spins on the wake word before sleeping."""
    liveness_interval_s: float = 0.5
    """How often tenant processes are checked for being alive."""
    gpu_waits: bool = True
    """Whether a lone same-GPU tenant's call may be taken before its input copy is done, its GEMM
    queued on the tenant's own stream behind a GPU wait (else such calls wait on the host)."""
    input_timeout_s: float = 30.0
    """How long a same-GPU tenant's input copy may take to finish before the tenant is detached."""

    def __post_init__(self):
        urls.parse(f"local://{self.name}")
        if not 0 < self.mailbox_bytes <= self.max_mailbox_bytes:
            raise ValueError(
                f"need 0 < mailbox_bytes ({self.mailbox_bytes}) <= max_mailbox_bytes ({self.max_mailbox_bytes})"
            )


class LocalServer(LocalControl):
    def __init__(self, core: ExecutorCore, catalog: pb.CatalogReply, skeleton: pb.SkeletonReply, config: LocalServerConfig):
        self.core = core
        self.catalog = catalog
        self.skeleton = skeleton
        self.config = config
        self.endpoint = urls.control_endpoint(config.name)
        self.lock = threading.RLock()  # a call run while draining delivers under it too
        self.tenants: dict[int, Tenant] = {}
        # detached tenants' and outgrown data areas are released by the data loop between
        # batches (never under a running batch; the scheduler is only ever touched by that thread)
        self.areas = AreaPool(config.name, core.device)
        self._stream = None  # the data loop's CUDA stream, on a GPU executor
        self._next_id = 1
        self.wake_fd, self._wake_mem = mailbox.create_region(f"symbiont-{config.name}-wake", mailbox.WAKE_BYTES)
        self.wake = Doorbell(self._wake_mem, 0)
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self._control_done = threading.Event()

    # ---- lifecycle ----------------------------------------------------------

    def serve(self) -> None:
        """Serves until stop(); then finishes every call already received and returns."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        path = self.endpoint[len("ipc://") :]
        if os.path.exists(path):
            probe = ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(self.endpoint)
            probe.send(pb.ControlRequest(health=pb.HealthRequest()).SerializeToString())
            live = probe.poll(500)
            probe.close()
            if live:
                raise RuntimeError(f"an executor already serves local://{self.config.name} ({path})")
            os.unlink(path)
        sock.bind(self.endpoint)
        control = threading.Thread(target=self._control_loop, args=(sock,), name="control", daemon=True)
        control.start()
        try:
            self._data_loop()
        finally:
            self._control_done.set()
            control.join(timeout=5)
            sock.close()
            with self.lock:
                for t in list(self.tenants.values()):
                    self._reclaim(t, "executor shutting down", release=True)
            self._release_retired()
            self.areas.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self.stopping.set()
        self.wake.ring()

    # ---- data plane ---------------------------------------------------------

    def _data_loop(self) -> None:
        if self.core.device.type == "cuda":
            torch.cuda.set_device(self.core.device)
            self._stream = torch.cuda.current_stream(self.core.device)
        next_liveness = time.monotonic() + self.config.liveness_interval_s
        while True:
            seq = self.wake.seq()
            stopping = self.stopping.is_set()
            if not self._gpu_waits():  # freeing memory may wait for every stream of our GPU
                self._release_retired()
            with self.lock:
                tenants = list(self.tenants.values())
                got = sum(self._drain_safely(t, stopping) for t in tenants)
            ran = False
            while True:
                can_grow = self.core.scheduler.waiting_tenants() < len(tenants) and not stopping
                results = self.core.step(time.monotonic(), can_grow)
                if not results:
                    break
                self._deliver(results)
                ran = True
            if stopping and self.core.scheduler.pending() == 0:
                log.info("drained; %d calls served", self.core.counters.calls)
                return
            now = time.monotonic()
            if now >= next_liveness:
                self._check_liveness()
                next_liveness = now + self.config.liveness_interval_s
            if ran or got:
                continue
            deadline = self.core.scheduler.next_deadline()
            until = min(next_liveness, deadline) if deadline is not None else next_liveness
            if any(t.held for t in tenants):  # an input copy is running on the GPU: poll it soon
                until = min(until, time.monotonic() + HELD_POLL_S)
            self.wake.wait(seq, self.config.spin_us, max(0, int((until - time.monotonic()) * 1e6)))

    def _drain_safely(self, t: Tenant, stopping: bool) -> int:
        try:
            return self._drain(t, stopping)
        except Exception as e:  # whatever one tenant sends, the loop serves the others
            log.exception("tenant %d broke the data loop", t.id)
            self._reclaim(t, f"internal error on its call: {type(e).__name__}: {e}")
            return 0

    def _drain(self, t: Tenant, stopping: bool) -> int:
        """Moves every call in t's request ring into the core (or answers it with an error).

        A same-GPU call whose input copy is still running either runs at once on the tenant's own
        stream, which the GPU makes wait for the copy (when no other tenant's call could join it
        in a batch), or is held until the copy is done (its successors wait behind it)."""
        n = 0
        while self.tenants.get(t.id) is t:  # an error reply may have detached it
            if t.held is not None:
                req, since = t.held
                if not self._input_in(t, req):
                    if self._run_waiting(t, req):
                        t.held = None
                        continue
                    if time.monotonic() - since > self.config.input_timeout_s:
                        self._reclaim(t, f"its input copy did not finish within {self.config.input_timeout_s:.0f} s")
                    return n
                t.held = None
            else:
                try:
                    raw = t.box.requests.pop()
                except ValueError as e:
                    self._reclaim(t, f"corrupt request ring ({e})")
                    return n
                if raw is None:
                    return n
                n += 1
                t.last_call = time.monotonic()
                try:
                    req = pb.CallRequest.FromString(raw)
                except DecodeError as e:
                    self.core.counters.errors += 1
                    self._reply_error(t, 0, CallError(pb.MALFORMED, f"call bytes do not parse as CallRequest: {e}"))
                    continue
                if t.gpu is not None and not stopping and not self._input_in(t, req):
                    if not self._run_waiting(t, req):
                        log.debug("call %d of tenant %d held for its input (input_seq %d)", req.call_id, t.id, req.input_seq)
                        t.held = (req, time.monotonic())
                    continue
            if stopping:
                self._reply_error(t, req.call_id, CallError(pb.UNAVAILABLE, "executor is shutting down"))
                continue
            try:
                self.core.submit(self._to_call(t, req))
            except CallError as e:
                self.core.counters.errors += 1
                self._reply_error(t, req.call_id, e)
        return n

    def _input_in(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Whether a same-GPU call's input copy has finished."""
        if req.input_seq and t.areas.words:
            return reached(t.box.input_word(), req.input_seq)
        return t.gpu.input_ready.query()

    def _run_waiting(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Runs a call whose input is still being copied on t's own stream, behind a GPU wait for
        its input word, when nothing would join it in a batch anyway (every other tenant already
        has a call in). The host never waits for the tenant's GPU work, and a tenant whose copy
        never ends stalls only its own stream. False when the call must be held instead."""
        areas = t.areas
        if not (self.config.gpu_waits and req.input_seq and areas.stream is not None):
            return False
        unit = self.core.table.get(req.unit)
        if unit is None or unit.kind == "embedding":  # its ids are checked on the host
            return False
        if self.core.scheduler.waiting(t.id):
            # an earlier call of t is queued: its GEMM must be on the GPU before anything waits for
            # an input the tenant's GPU makes only after that GEMM's output (else a synchronising
            # CUDA call of ours, run meanwhile, would wait forever)
            return False
        if any(self._may_join(o, t) for o in self.tenants.values()):
            return False
        if not areas.warm:
            # A GEMM on a stream this thread has not used yet synchronises our GPU (cuBLAS sets up
            # the stream's workspace): do that once, while no stream of ours waits on a tenant.
            if self._gpu_waits():
                return False
            self.core.warm_up(areas.stream)
            areas.warm = True
        try:
            call = self._to_call(t, req)
        except CallError as e:
            self.core.counters.errors += 1
            self._reply_error(t, req.call_id, e)
            return True
        stream = areas.stream
        log.debug("call %d of tenant %d taken before its input is in: the GPU waits for it", req.call_id, t.id)
        if not areas.waiting():
            t.waiting_since = time.monotonic()  # (stays while a stuck stream keeps getting calls)
        stream_wait(stream.cuda_stream, areas.words, req.input_seq)
        areas.awaiting = req.input_seq  # (releasing it releases any before)
        call.tag.stream = stream
        torch.cuda.set_stream(stream)  # (torch.cuda.stream() costs ~17 us of host time more)
        try:
            self._deliver(self.core.run_now(call))
        finally:
            torch.cuda.set_stream(self._stream)
        return True

    def _may_join(self, o: Tenant, t: Tenant) -> bool:
        """Whether tenant o may send a call soon enough to share a batch with t's: it has none in,
        and it called within the longest wait the scheduler gives a call."""
        if o is t or o.held is not None or self.core.scheduler.waiting(o.id):
            return False
        return time.monotonic() - o.last_call < self.core.scheduler.config.max_wait_us * 1e-6

    def _to_call(self, t: Tenant, req: pb.CallRequest) -> Call:
        if req.payload:
            raise CallError(pb.INVALID_ARGUMENT, "local:// calls carry tensors in the mailbox, not in payload")
        unit, in_shape, out_shape, dtype = self.core.check(req.unit, req.op, req.dtype, req.shape)
        out_dtype = self.core.dtype
        in_bytes = codec.nbytes(in_shape, dtype)
        out_bytes = codec.nbytes(out_shape, out_dtype)
        cap = t.areas.data_bytes
        if in_bytes + out_bytes > self.config.max_mailbox_bytes:
            raise CallError(
                pb.RESOURCE_EXHAUSTED,
                f"call too large: input and output need {in_bytes + out_bytes} bytes, a mailbox may hold at most "
                f"{self.config.max_mailbox_bytes} (--max-mailbox-mb)",
            )
        for what, off, size, item in (("input", req.in_offset, in_bytes, dtype.itemsize), ("output", req.out_offset, out_bytes, out_dtype.itemsize)):
            if off % item:
                raise CallError(pb.INVALID_ARGUMENT, f"{what} offset {off} is not aligned to {item} bytes")
            if off + size > cap:
                raise CallError(
                    pb.INVALID_ARGUMENT,
                    f"{what} bytes [{off}, {off + size}) lie outside the mailbox's data area of {cap} bytes (grow it first)",
                )
        if req.in_offset < req.out_offset + out_bytes and req.out_offset < req.in_offset + in_bytes:
            raise CallError(pb.INVALID_ARGUMENT, f"input bytes at {req.in_offset} and output bytes at {req.out_offset} overlap")
        area = t.area
        x = area.view(req.in_offset, in_shape, dtype)
        out = None
        if x.device != self.core.device:
            x = x.to(self.core.device, non_blocking=bool(t.areas.pinned))  # a copy, DMA when page-locked
        elif unit.kind == "embedding":
            x = x.clone()  # the ids checked must be the ids looked up: the tenant can rewrite its mailbox
        else:  # a call run alone writes straight into the output mailbox
            out = area.view(req.out_offset, (in_shape[0], out_shape[-1]), out_dtype)
        if unit.kind == "embedding":
            self.core.check_ids(unit, x)
        return Call(
            tenant=t.id,
            call_id=req.call_id,
            unit=unit,
            op=req.op,
            x=x,
            out_shape=out_shape,
            latency=req.latency,
            arrived=time.monotonic(),
            tag=Delivery(t, area, req.out_offset, req.input_seq),
            out=out,
        )

    def _deliver(self, results: list[Result]) -> None:
        told: dict[int, _Told] = {}  # by tenant id
        with self.lock:
            for r in results:
                d = r.call.tag
                t = d.tenant
                if self.tenants.get(t.id) is not t or t.area is not d.area:
                    continue  # detached or regrown mid-call: nobody to tell
                try:
                    reply = self._deliver_one(t, r, d.out_offset)
                except Exception as e:  # one tenant's failed reply never stops the others'
                    log.exception("delivering to tenant %d failed", t.id)
                    self._reclaim(t, f"its reply could not be delivered: {type(e).__name__}")
                    continue
                out = told.setdefault(t.id, _Told(d.stream or self._stream))
                if d.input_seq and t.areas.out_word:
                    # a failed call's word is the tenant's to write (client/transports/unanswered.py)
                    if r.error is None and (not out.seq or reached(d.input_seq, out.seq)):
                        out.seq = d.input_seq
                else:
                    out.event = True
                out.replies.append(reply)
            for tid, out in told.items():
                t = self.tenants.get(tid)
                if t is None:
                    continue
                # before any reply: the tenant's GPU (or its host, told by the reply) waits for our writes
                if out.seq:
                    stream_write(out.stream.cuda_stream, t.areas.out_word, out.seq)
                if out.event and t.gpu is not None:
                    t.gpu.output_ready.record(out.stream)
                for reply in out.replies:
                    self._push(t, reply)
                t.box.reply_bell.ring()

    def _deliver_one(self, t: Tenant, r: Result, out_offset: int) -> pb.CallReply:
        """Writes r's result into t's mailbox (unless the GEMM wrote it there); returns its reply."""
        if r.error is not None:
            return pb.CallReply(call_id=r.call.call_id, status=r.error.status())
        y = r.y
        dest = t.area.view(out_offset, y.shape, y.dtype)
        if dest.data_ptr() != y.data_ptr():  # not already written there by the GEMM
            dest.copy_(y)
        reply = pb.CallReply(
            call_id=r.call.call_id, status=_OK, dtype=codec.dtype_enum(y.dtype), shape=list(y.shape), out_offset=out_offset
        )
        return reply

    def _reply_error(self, t: Tenant, call_id: int, err: CallError) -> None:
        self._push(t, pb.CallReply(call_id=call_id, status=err.status()))
        if t.id in self.tenants:
            t.box.reply_bell.ring()

    def _push(self, t: Tenant, reply: pb.CallReply) -> None:
        if t.id in self.tenants and not t.box.replies.push(reply.SerializeToString()):
            self._reclaim(t, f"reply ring full: the tenant has not read its last {mailbox.RING_SLOTS} replies")

    def _check_liveness(self) -> None:
        now = time.monotonic()
        with self.lock:
            for t in list(self.tenants.values()):
                if not owner_alive(t.owner):
                    self._reclaim(t, f"process {t.pid} is gone", release=True)
                elif t.areas.waiting() and now - t.waiting_since > self.config.input_timeout_s:
                    self._reclaim(t, f"its input copy did not finish within {self.config.input_timeout_s:.0f} s", release=True)
            if self._gpu_waits():
                return
        self.areas.reap()

    def _gpu_waits(self) -> bool:
        """Whether a tenant's stream still waits on the GPU for its input."""
        with self.lock:
            return any(t.areas.waiting() for t in self.tenants.values()) or self.areas.any_waiting()

    def _reclaim(self, t: Tenant, why: str, release: bool = False) -> None:
        """Detaches t (caller holds the lock). A tenant still waiting learns it from its mailbox;
        its queued calls and memory are released by the data loop between batches. release: let
        our stream's wait for its input go now (it is dead, stalled, or we stop); otherwise the
        call it already has a reply for still gets its input, and its areas wait for that."""
        if self.tenants.pop(t.id, None) is None:
            return
        if release:
            t.areas.release_wait()
        t.box.mark_detached()
        self.areas.retire(t.areas, t.owner)
        self.wake.ring()
        log.info("tenant %d (%s, pid %d) detached: %s", t.id, t.name, t.pid, why)

    def _release_retired(self) -> None:
        """Data loop only, between batches: drops retired areas' queued calls, releases them."""

        def drop_calls(area) -> None:
            dropped = self.core.scheduler.drop(lambda c: c.tag.area is area)
            if dropped:
                log.info("%d queued calls on a released mailbox dropped", dropped)

        self.areas.release_retired(drop_calls)


_OK = pb.Status(code=pb.OK)
