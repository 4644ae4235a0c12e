"""Same-host transport server (`local://NAME`): ZeroMQ control on a unix socket, tensors in
executor-owned per-tenant shared-memory mailboxes, signalling through the csrc doorbell rings.

A tenant on the executor's own GPU gets its data area in device memory instead (proto/cuda_ipc.py):
shared once by CUDA IPC handle, ordered by two interprocess events, so no call synchronises the
host; the rings and doorbells stay in host shared memory.

Two threads: the control thread answers ControlRequests (attach, grow, detach, catalog,
skeleton, stats, health); the data loop waits on the executor-wide wake word, drains every
tenant's request ring into the core, steps the core, writes results into mailboxes and rings
each tenant's reply doorbell. Nothing here blocks on a tenant: a tenant that dies, corrupts
its ring or never reads its replies is detached and its mailbox reclaimed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING

import torch
import zmq
from google.protobuf.message import DecodeError

from base_executor.core import CallError, ExecutorCore, Result, clip
from base_executor.scheduler import Call
from proto import codec, mailbox, urls
from proto.procs import alive
from proto import executor_pb2 as pb
from proto._doorbell import Doorbell

if TYPE_CHECKING:
    from proto.cuda_ipc import DeviceRegion

log = logging.getLogger("base_executor")


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

    def __post_init__(self):
        urls.parse(f"local://{self.name}")
        if not 0 < self.mailbox_bytes <= self.max_mailbox_bytes:
            raise ValueError(
                f"need 0 < mailbox_bytes ({self.mailbox_bytes}) <= max_mailbox_bytes ({self.max_mailbox_bytes})"
            )


@dataclasses.dataclass(eq=False)
class Tenant:
    id: int
    name: str
    pid: int
    token: str
    fd: int
    box: mailbox.Mailbox  # rings, reply doorbell, and the data area of a host tenant
    gpu: "DeviceRegion | None" = None  # the data area of a tenant on the executor's GPU

    @property
    def data_bytes(self) -> int:
        return self.gpu.nbytes if self.gpu is not None else self.box.data_bytes

    @property
    def area(self):
        """Where this tenant's tensors live: its device region, else its host mailbox."""
        return self.gpu or self.box


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class LocalServer:
    def __init__(self, core: ExecutorCore, catalog: pb.CatalogReply, skeleton: pb.SkeletonReply, config: LocalServerConfig):
        self.core = core
        self.catalog = catalog
        self.skeleton = skeleton
        self.config = config
        self.endpoint = urls.control_endpoint(config.name)
        self.lock = threading.Lock()
        self.tenants: dict[int, Tenant] = {}
        # detached tenants and outgrown data areas, released by the data loop between batches
        # (never under a running batch, and the scheduler is only ever touched by that thread)
        self._retired: list[tuple[int, mailbox.Mailbox, object]] = []  # (fd, host mailbox, device region)
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
                    self._reclaim(t, "executor shutting down")
            self._release_retired()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self.stopping.set()
        self.wake.ring()

    # ---- data plane ---------------------------------------------------------

    def _data_loop(self) -> None:
        next_liveness = time.monotonic() + self.config.liveness_interval_s
        while True:
            seq = self.wake.seq()
            stopping = self.stopping.is_set()
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
            self.wake.wait(seq, self.config.spin_us, max(0, int((until - time.monotonic()) * 1e6)))

    def _drain_safely(self, t: Tenant, stopping: bool) -> int:
        try:
            return self._drain(t, stopping)
        except Exception as e:  # whatever one tenant sends, the loop serves the others
            log.exception("tenant %d broke the data loop", t.id)
            self._reclaim(t, f"internal error on its call: {type(e).__name__}: {e}")
            return 0

    def _drain(self, t: Tenant, stopping: bool) -> int:
        """Moves every call in t's request ring into the core (or answers it with an error)."""
        n = 0
        while self.tenants.get(t.id) is t:  # an error reply may have detached it
            try:
                raw = t.box.requests.pop()
            except ValueError as e:
                self._reclaim(t, f"corrupt request ring ({e})")
                return n
            if raw is None:
                return n
            n += 1
            try:
                req = pb.CallRequest.FromString(raw)
            except DecodeError as e:
                self.core.counters.errors += 1
                self._reply_error(t, 0, CallError(pb.MALFORMED, f"call bytes do not parse as CallRequest: {e}"))
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

    def _to_call(self, t: Tenant, req: pb.CallRequest) -> Call:
        if req.payload:
            raise CallError(pb.INVALID_ARGUMENT, "local:// calls carry tensors in the mailbox, not in payload")
        unit, in_shape, out_shape, dtype = self.core.check(req.unit, req.op, req.dtype, req.shape)
        out_dtype = self.core.dtype
        in_bytes = codec.nbytes(in_shape, dtype)
        out_bytes = codec.nbytes(out_shape, out_dtype)
        cap = t.data_bytes
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
        if t.gpu is not None:  # the GEMM waits on the GPU for the tenant's copy-in, not here
            torch.cuda.current_stream(self.core.device).wait_event(t.gpu.input_ready)
        x = t.area.view(req.in_offset, in_shape, dtype)
        if x.device != self.core.device:
            x = x.to(self.core.device)  # a copy
        elif unit.kind == "embedding":
            x = x.clone()  # the ids checked must be the ids looked up: the tenant can rewrite its mailbox
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
            tag=(t, t.area, req.out_offset),
        )

    def _deliver(self, results: list[Result]) -> None:
        rung: set[int] = set()
        with self.lock:
            for r in results:
                t, area, out_offset = r.call.tag
                if self.tenants.get(t.id) is not t or t.area is not area:
                    continue  # detached or regrown mid-call: nobody to tell
                try:
                    self._deliver_one(t, r, out_offset)
                except Exception as e:  # one tenant's failed reply never stops the others'
                    log.exception("delivering to tenant %d failed", t.id)
                    self._reclaim(t, f"its reply could not be delivered: {type(e).__name__}")
                    continue
                rung.add(t.id)
            for tid in rung:
                t = self.tenants.get(tid)
                if t is not None:
                    if t.gpu is not None:  # the tenant's read waits on the GPU for our writes
                        t.gpu.output_ready.record(torch.cuda.current_stream(self.core.device))
                    t.box.reply_bell.ring()

    def _deliver_one(self, t: Tenant, r: Result, out_offset: int) -> None:
        if r.error is not None:
            self._push(t, pb.CallReply(call_id=r.call.call_id, status=r.error.status()))
            return
        y = r.y
        t.area.view(out_offset, y.shape, y.dtype).copy_(y)
        reply = pb.CallReply(
            call_id=r.call.call_id, status=_OK, dtype=codec.dtype_enum(y.dtype), shape=list(y.shape), out_offset=out_offset
        )
        self._push(t, reply)

    def _reply_error(self, t: Tenant, call_id: int, err: CallError) -> None:
        self._push(t, pb.CallReply(call_id=call_id, status=err.status()))
        if t.id in self.tenants:
            t.box.reply_bell.ring()

    def _push(self, t: Tenant, reply: pb.CallReply) -> None:
        if t.id in self.tenants and not t.box.replies.push(reply.SerializeToString()):
            self._reclaim(t, f"reply ring full: the tenant has not read its last {mailbox.RING_SLOTS} replies")

    def _check_liveness(self) -> None:
        with self.lock:
            for t in list(self.tenants.values()):
                if not alive(t.pid):
                    self._reclaim(t, f"process {t.pid} is gone")

    def _reclaim(self, t: Tenant, why: str) -> None:
        """Detaches t (caller holds the lock). A tenant still waiting learns it from its mailbox;
        its queued calls and memory are released by the data loop between batches."""
        if self.tenants.pop(t.id, None) is None:
            return
        t.box.mark_detached()
        self._retired.append((t.fd, t.box, t.gpu))
        self.wake.ring()
        log.info("tenant %d (%s, pid %d) detached: %s", t.id, t.name, t.pid, why)

    def _release_retired(self) -> None:
        """Data loop only, between batches: drops retired tenants' queued calls, frees their areas."""
        with self.lock:
            retired, self._retired = self._retired, []
        for fd, box, gpu in retired:
            area = gpu or box  # calls still queued on it read it: they go first
            dropped = self.core.scheduler.drop(lambda c: c.tag[1] is area)
            if dropped:
                log.info("%d queued calls on a released mailbox dropped", dropped)
            box.close()
            os.close(fd)
            if gpu is not None:
                gpu.free()

    # ---- control plane ------------------------------------------------------

    def _control_loop(self, sock) -> None:
        while not self._control_done.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            identity, payload = frames[0], frames[-1]
            try:
                reply = self._control(payload)
            except Exception as e:  # a bug must not kill the control plane
                log.exception("control request failed")
                reply = pb.ControlReply(status=pb.Status(code=pb.INTERNAL, message=clip(f"{type(e).__name__}: {e}")))
            sock.send_multipart([identity, reply.SerializeToString()])

    def _control(self, payload: bytes) -> pb.ControlReply:
        try:
            req = pb.ControlRequest.FromString(payload)
        except DecodeError as e:
            return _error(pb.MALFORMED, f"control bytes do not parse as ControlRequest: {e}")
        kind = req.WhichOneof("kind")
        if kind is None:
            return _error(pb.MALFORMED, "empty ControlRequest: set one of attach, detach, grow, catalog, skeleton, stats, health")
        if kind == "health":
            return pb.ControlReply(
                status=_OK,
                health=pb.HealthReply(
                    serving=not self.stopping.is_set(),
                    model=self.catalog.model,
                    tenants=len(self.tenants),
                    uptime_s=time.monotonic() - self.started,
                ),
            )
        if kind == "catalog":
            return pb.ControlReply(status=_OK, catalog=self.catalog)
        if kind == "skeleton":
            return pb.ControlReply(status=_OK, skeleton=self.skeleton)
        if kind == "stats":
            return pb.ControlReply(status=_OK, stats=self._stats())
        if self.stopping.is_set():
            return _error(pb.UNAVAILABLE, "executor is shutting down")
        if kind == "attach":
            return self._attach(req.attach)
        with self.lock:
            t = self.tenants.get(req.tenant_id)
            if t is None or not secrets.compare_digest(t.token, req.token):
                return _error(pb.NOT_ATTACHED, f"tenant {req.tenant_id} is not attached (never attached, detached, or reclaimed)")
            if kind == "detach":
                self._reclaim(t, "detach requested")
                return pb.ControlReply(status=_OK)
            if kind == "grow":
                return self._grow(t, req.grow.data_bytes)
        return _error(pb.INTERNAL, f"unhandled control request {kind}")

    def _attach(self, a: pb.AttachRequest) -> pb.ControlReply:
        if a.pid <= 0:
            return _error(pb.INVALID_ARGUMENT, f"attach needs the tenant's pid, got {a.pid}")
        size = a.mailbox_bytes or self.config.mailbox_bytes
        on_gpu = bool(a.device_uuid) and a.device_uuid == self.catalog.device_uuid
        if size > self.config.max_mailbox_bytes:
            return _error(pb.RESOURCE_EXHAUSTED, f"mailbox of {size} bytes asked, at most {self.config.max_mailbox_bytes}")
        with self.lock:
            if len(self.tenants) >= self.config.max_tenants:
                return _error(pb.RESOURCE_EXHAUSTED, f"executor full: {len(self.tenants)} tenants attached (max {self.config.max_tenants})")
            tid = self._next_id
            self._next_id += 1
            fd, box = self._new_mailbox(tid, 0 if on_gpu else size)
            gpu = self._new_region(size) if on_gpu else None
            t = Tenant(id=tid, name=a.tenant_name or f"tenant-{tid}", pid=a.pid, token=secrets.token_hex(16), fd=fd, box=box, gpu=gpu)
            self.tenants[tid] = t
        log.info("tenant %d (%s, pid %d) attached; mailbox %d MiB on %s", tid, t.name, t.pid, size >> 20,
                 f"{self.core.device} (CUDA IPC)" if on_gpu else "the host (shared memory)")
        self.wake.ring()
        return pb.ControlReply(
            status=_OK,
            attach=pb.AttachReply(
                tenant_id=tid,
                token=t.token,
                wake=pb.SharedRegion(owner_pid=os.getpid(), fd=self.wake_fd, size=mailbox.WAKE_BYTES),
                mailbox=pb.SharedRegion(owner_pid=os.getpid(), fd=fd, size=mailbox.Mailbox.total_bytes(box.data_bytes)),
                ring_slots=mailbox.RING_SLOTS,
                ring_slot_size=mailbox.RING_SLOT_SIZE,
                data_offset=mailbox.DATA_OFFSET,
                data_bytes=t.data_bytes,
                max_mailbox_bytes=self.config.max_mailbox_bytes,
                cuda=_cuda_region(gpu),
            ),
        )

    def _new_mailbox(self, tid: int, data_bytes: int) -> tuple[int, mailbox.Mailbox]:
        fd, mem = mailbox.create_region(f"symbiont-{self.config.name}-t{tid}", mailbox.Mailbox.total_bytes(data_bytes))
        return fd, mailbox.Mailbox(mem, data_bytes)

    def _new_region(self, nbytes: int) -> "DeviceRegion":
        from proto.cuda_ipc import DeviceRegion

        return DeviceRegion.allocate(self.core.device, nbytes)

    def _grow(self, t: Tenant, data_bytes: int) -> pb.ControlReply:
        if data_bytes > self.config.max_mailbox_bytes:
            return _error(
                pb.RESOURCE_EXHAUSTED,
                f"mailbox of {data_bytes} bytes asked, at most {self.config.max_mailbox_bytes} (--max-mailbox-mb)",
            )
        # the outgrown area is released by the data loop; calls still queued on it get no reply
        if data_bytes > t.data_bytes and t.gpu is not None:
            old_gpu, t.gpu = t.gpu, self._new_region(data_bytes)
            fd, box = self._new_mailbox(t.id, 0)
            self._retired.append((t.fd, t.box, old_gpu))
            t.fd, t.box = fd, box
            log.info("tenant %d device mailbox grown to %d MiB", t.id, data_bytes >> 20)
        elif data_bytes > t.data_bytes:
            fd, box = self._new_mailbox(t.id, data_bytes)
            self._retired.append((t.fd, t.box, None))
            t.fd, t.box = fd, box
            log.info("tenant %d mailbox grown to %d MiB", t.id, data_bytes >> 20)
        return pb.ControlReply(
            status=_OK,
            grow=pb.GrowReply(
                mailbox=pb.SharedRegion(owner_pid=os.getpid(), fd=t.fd, size=mailbox.Mailbox.total_bytes(t.box.data_bytes)),
                data_offset=mailbox.DATA_OFFSET,
                data_bytes=t.data_bytes,
                cuda=_cuda_region(t.gpu),
            ),
        )

    def _mailbox_bytes(self) -> int:
        with self.lock:
            return sum(mailbox.Mailbox.total_bytes(t.box.data_bytes) + (t.gpu.nbytes if t.gpu else 0) for t in self.tenants.values())

    def _stats(self) -> pb.StatsReply:
        k = self.core.counters
        return pb.StatsReply(
            tenants=len(self.tenants),
            calls=k.calls,
            batches=k.batches,
            tokens=k.tokens,
            errors=k.errors,
            rss_anon_bytes=rss_anon_bytes(),
            mailbox_bytes=self._mailbox_bytes(),
            units=[
                pb.UnitStats(unit=u, calls=k.per_unit[u], batches=k.per_unit_batches[u], tokens=k.per_unit_tokens[u])
                for u in sorted(k.per_unit)
            ],
        )


_OK = pb.Status(code=pb.OK)


def _cuda_region(gpu) -> pb.CudaRegion | None:
    if gpu is None:
        return None
    mem, inp, out = gpu.handles()
    return pb.CudaRegion(mem_handle=mem, size=gpu.nbytes, input_ready=inp, output_ready=out)


def _error(code: int, message: str) -> pb.ControlReply:
    return pb.ControlReply(status=pb.Status(code=code, message=message))
