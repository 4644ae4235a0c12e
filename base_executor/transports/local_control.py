"""The control plane of the same-host transport server (`local://NAME`): one ZeroMQ ROUTER
socket on its own thread answering ControlRequests — attach, grow, detach, catalog, skeleton,
stats, health. A mixin of LocalServer (transports/local.py), which owns the tenants, their
areas and the data loop; nothing here touches the scheduler."""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import time

import torch

from google.protobuf.message import DecodeError

from symbiont.base_executor.adapters import PROVIDER, AdapterError
from symbiont.base_executor.core import clip
from symbiont.base_executor.transports.areas import Areas, Tenant, owner_alive, owner_of
from symbiont.proto import mailbox
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")
_OK = pb.Status(code=pb.OK)
ADAPTER_KINDS = ("host_adapter", "adapters", "remove_adapter")


def rss_anon_bytes() -> int:
    """The process's private resident memory, after the C heap has handed its free pages back
    (transient buffers, a whole-MLP call's for one, would otherwise count as held)."""
    _trim_heap()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _trim_heap() -> None:
    """glibc's malloc_trim(0): returns the free pages of every malloc arena to the OS (a no-op
    elsewhere). Runs on stats requests only."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


class LocalControl:
    """Control requests of LocalServer; `self` is the LocalServer."""

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
            return control_error(pb.MALFORMED, f"control bytes do not parse as ControlRequest: {e}")
        kind = req.WhichOneof("kind")
        if kind is None:
            return control_error(pb.MALFORMED, "empty ControlRequest: set one of attach, detach, grow, catalog, skeleton, stats, health, norms, "
                                 "host_adapter, adapters, remove_adapter, program")
        if kind == "health":
            return pb.ControlReply(
                status=_OK,
                health=pb.HealthReply(
                    serving=not self.stopping.is_set(),
                    model=self.catalog.model,
                    tenants=len(self.tenants) + len(self.remote),
                    uptime_s=time.monotonic() - self.started,
                ),
            )
        if kind == "catalog":
            return pb.ControlReply(status=_OK, catalog=self.catalog)
        if kind == "skeleton":
            return pb.ControlReply(status=_OK, skeleton=self.skeleton)
        if kind == "stats":
            return pb.ControlReply(status=_OK, stats=self._stats())
        if kind == "norms":
            return self._norms(req.norms.unit)
        if self.stopping.is_set():
            return control_error(pb.UNAVAILABLE, "executor is shutting down")
        if kind == "attach":
            return self._attach(req.attach)
        if req.tenant_id == PROVIDER and kind in ADAPTER_KINDS:  # the provider's shared adapters (base-executor adapters)
            if not secrets.compare_digest(req.token, self.provider_token):
                log.warning("a provider request with a wrong token was refused")
                return control_error(pb.UNAUTHENTICATED, "not the provider's token (base-executor adapters reads it "
                                     "from the executor's run directory)")
            with self.lock:
                return self.adapter_control(PROVIDER, req)
        with self.lock:
            t = self.tenants.get(req.tenant_id)
            if t is None or not secrets.compare_digest(t.token, req.token):
                return control_error(pb.NOT_ATTACHED, f"tenant {req.tenant_id} is not attached (never attached, detached, or reclaimed)")
            if kind == "detach":
                self._reclaim(t, "detach requested")
                return pb.ControlReply(status=_OK)
            if kind in ADAPTER_KINDS:
                return self.adapter_control(t.id, req)
        if kind == "grow":  # (its new areas are made outside the lock, as an attach's)
            return self._grow(t, req.grow.data_bytes)
        if kind == "program":  # (the data loop captures it: transports/programs.py)
            return self._define_program(t, req.program)
        return control_error(pb.INTERNAL, f"unhandled control request {kind}")

    def adapter_control(self, owner: int, req: pb.ControlRequest) -> pb.ControlReply:
        """host_adapter, adapters, remove_adapter of tenant `owner` (local or remote; caller holds
        the lock): its own adapters and the provider's."""
        kind = req.WhichOneof("kind")
        registry = self.core.adapters
        try:
            if kind == "host_adapter":
                if self.core.tp is not None:
                    return control_error(pb.INVALID_ARGUMENT, "hosted adapters are not served under tensor placement yet "
                                         "(layer placement hosts them: each rank its units' share)")
                adapter = registry.host(owner, req.host_adapter)
                log.info("tenant %d hosted adapter %r (%d units)", owner, adapter.name, len(adapter.deltas))
                return pb.ControlReply(status=_OK, host_adapter=adapter.info())
            if kind == "adapters":
                found = registry.visible(owner, req.adapters.name)
                if req.adapters.name:  # a tenant's model names it: its calls come next
                    for adapter in found:
                        registry.prefetch(adapter)
                return pb.ControlReply(status=_OK, adapters=pb.AdaptersReply(adapters=[a.info() for a in found]))
            removed = registry.remove(owner, req.remove_adapter.name)
            self._unlearn_adapter(owner, removed.id)
            return pb.ControlReply(status=_OK)
        except AdapterError as e:
            return control_error(e.code, str(e))

    def _norms(self, unit_id: str) -> pb.ControlReply:
        """The squared norms of a linear unit's weight's output rows, float32 (what DoRA needs of
        it), computed once per unit on a stream of their own (a tenant's stalled stream is never
        waited for)."""
        from symbiont.base_executor.catalog import CONV1D, LINEAR

        unit = self.core.table.get(unit_id)
        if unit is None:
            return control_error(pb.UNKNOWN_UNIT, f"unit {unit_id!r} is not served by this executor")
        if unit.kind not in (LINEAR, CONV1D):
            return control_error(pb.INVALID_ARGUMENT, f"unit {unit_id!r} is a {unit.kind} unit: norms are of linear units' weights")
        if unit.weight is None:  # (--placement tensor: this rank holds a slice)
            return control_error(pb.INVALID_ARGUMENT, f"unit {unit_id!r}: its norms (DoRA) are not served by an executor "
                                 "with --placement tensor; serve with --placement layers")
        if unit_id not in self._row_norms:
            w = unit.weight
            dim = 1 if unit.kind == LINEAR else 0  # (a Conv1D's weight is [in, out])
            if w.device.type == "cuda":
                if self._norms_stream is None:
                    self._norms_stream = torch.cuda.Stream(w.device)
                with torch.cuda.stream(self._norms_stream):
                    norms = torch.linalg.vector_norm(w, dim=dim, dtype=torch.float32).square().cpu()
            else:
                norms = torch.linalg.vector_norm(w, dim=dim, dtype=torch.float32).square()
            self._row_norms[unit_id] = norms.tolist()
        return pb.ControlReply(status=_OK, norms=pb.NormsReply(squared=self._row_norms[unit_id]))

    def _attach(self, a: pb.AttachRequest) -> pb.ControlReply:
        if a.pid <= 0:
            return control_error(pb.INVALID_ARGUMENT, f"attach needs the tenant's pid, got {a.pid}")
        owner = owner_of(a.pid)
        if not owner_alive(owner):
            return control_error(pb.INVALID_ARGUMENT, f"attach names pid {a.pid}, which is no process on this host")
        size = a.mailbox_bytes or self.config.mailbox_bytes
        on_gpu = bool(a.device_uuid) and a.device_uuid == self.catalog.device_uuid
        if size > self.config.max_mailbox_bytes:
            return control_error(pb.RESOURCE_EXHAUSTED, f"mailbox of {size} bytes asked, at most {self.config.max_mailbox_bytes}")
        with self.lock:
            if (full := self._full()) is not None:
                return control_error(pb.RESOURCE_EXHAUSTED, full)
            tid = self._next_id
            self._next_id += 1
            self._attaching += 1  # (a place kept while its mailbox is made)
        # (not under the lock, which the data loop takes every round: making a device mailbox
        # queues GPU work, which may wait behind a stream that waits for a tenant's input, and
        # that input may need the data loop to go on)
        counted = True
        try:
            areas = self.areas.new(tid, owner, size, on_gpu)
            t = Tenant(id=tid, name=a.tenant_name or f"tenant-{tid}", pid=a.pid, owner=owner, token=secrets.token_hex(16), areas=areas)
            with self.lock:
                self._attaching -= 1
                counted = False
                if self.stopping.is_set():  # (shut down meanwhile: its tenants are reclaimed already)
                    self.areas.retire(areas, owner)
                    return control_error(pb.UNAVAILABLE, "executor is shutting down")
                self.tenants[tid] = t
        finally:
            if counted:  # (making its mailbox failed)
                with self.lock:
                    self._attaching -= 1
        log.info("tenant %d (%s, pid %d) attached; mailbox %d MiB on %s", tid, t.name, t.pid, size >> 20,
                 f"{self.core.device} (CUDA IPC)" if on_gpu else "the host (shared memory" + (", page-locked)" if areas.pinned else ")"))
        self.wake.ring()
        return pb.ControlReply(
            status=_OK,
            attach=pb.AttachReply(
                tenant_id=tid,
                token=t.token,
                wake=pb.SharedRegion(owner_pid=os.getpid(), fd=self.wake_fd, size=mailbox.WAKE_BYTES),
                mailbox=_shared(areas),
                ring_slots=mailbox.RING_SLOTS,
                ring_slot_size=mailbox.RING_SLOT_SIZE,
                data_offset=mailbox.DATA_OFFSET,
                data_bytes=areas.data_bytes,
                max_mailbox_bytes=self.config.max_mailbox_bytes,
                cuda=_cuda_region(areas),
            ),
        )

    def _grow(self, t: Tenant, data_bytes: int) -> pb.ControlReply:
        if data_bytes > self.config.max_mailbox_bytes:
            return control_error(
                pb.RESOURCE_EXHAUSTED,
                f"mailbox of {data_bytes} bytes asked, at most {self.config.max_mailbox_bytes} (--max-mailbox-mb)",
            )
        if data_bytes > t.areas.data_bytes:  # the outgrown areas go; calls still queued on them get no reply
            grown = self.areas.new(t.id, t.owner, data_bytes, t.gpu is not None)
            with self.lock:
                if self.tenants.get(t.id) is not t or self.stopping.is_set():  # (reclaimed meanwhile: its liveness, a bad call, shutdown)
                    self.areas.retire(grown, t.owner)
                    return control_error(pb.NOT_ATTACHED, f"tenant {t.id} was detached while its mailbox grew")
                t.held = None  # (nor a call held for its input there: its input_seq is the old mailbox's)
                self._leave_gangs(t.areas, "the tenant's mailbox grew: its step programs are gone, define them again")
                old, t.areas = t.areas, grown
                self._fold_lane(old)
                self.areas.retire(old, t.owner)
            log.info("tenant %d mailbox grown to %d MiB", t.id, data_bytes >> 20)
        return pb.ControlReply(
            status=_OK,
            grow=pb.GrowReply(
                mailbox=_shared(t.areas),
                data_offset=mailbox.DATA_OFFSET,
                data_bytes=t.areas.data_bytes,
                cuda=_cuda_region(t.areas),
            ),
        )

    def _mailbox_bytes(self) -> int:
        with self.lock:
            live = sum(t.areas.total_bytes for t in self.tenants.values())
        return live + self.areas.held_bytes()

    def _stats(self) -> pb.StatsReply:
        self._fold_lanes()
        k = self.core.counters
        sched = self.core.scheduler
        with self.lock:
            paths = {k: v for k, v in self.paths.items() if v}  # (local tenants' ways are counted under the lock)
            tenants = [
                pb.TenantStats(
                    tenant_id=t.id, name=t.name, pid=t.pid, placement="gpu" if t.gpu is not None else "cpu",
                    calls=k.per_tenant_calls[t.id], tokens=k.per_tenant_tokens[t.id], queued_calls=sched.queued(t.id),
                    mailbox_bytes=t.areas.total_bytes, refused=k.per_tenant_refused[t.id],
                )
                for t in self.tenants.values()
            ] + self._remote_stats(k)
        gpu = self.core.device.type == "cuda"
        return pb.StatsReply(
            policy=sched.config.policy,
            classes=[class_stats(latency, c, sched.waits_us[latency]) for latency, c in k.classes.items()],
            tenant_stats=tenants,
            uptime_s=time.monotonic() - self.started,
            flops=k.flops,
            refused=k.refused,
            gpu_allocated_bytes=torch.cuda.memory_allocated(self.core.device) if gpu else 0,
            gpu_reserved_bytes=torch.cuda.memory_reserved(self.core.device) if gpu else 0,
            queued_calls=sched.pending(),
            queued_tokens=sched.queued_tokens,
            hosted_adapters=len(self.core.adapters),
            adapter_bytes=self.core.adapters.bytes(),
            adapter_calls=k.adapter_calls,
            **self.core.merge_stats(),
            adapter_resident_bytes=self.core.adapters.resident_bytes(),
            adapter_hits=self.core.adapters.hits,
            adapter_misses=self.core.adapters.misses,
            adapter_evictions=self.core.adapters.evictions,
            tenants=len(tenants),
            calls=k.calls,
            batches=k.batches,
            tokens=k.tokens,
            errors=k.errors,
            rss_anon_bytes=rss_anon_bytes(),
            mailbox_bytes=self._mailbox_bytes(),
            graph_replays=k.graph_replays,
            graph_captures=k.graph_captures,
            native_calls=k.native_calls,
            call_paths=paths,
            loop_rounds=self.loop_rounds,
            loop_busy_s=self.loop_busy_s,
            units=[
                pb.UnitStats(unit=u, calls=k.per_unit[u], batches=k.per_unit_batches[u], tokens=k.per_unit_tokens[u])
                for u in sorted(k.per_unit)
            ],
        )



def class_stats(latency: int, c, waits) -> pb.ClassStats:
    waits = sorted(waits)  # (a C-level copy of the deque: safe while the data loop appends)

    def pct(q: float) -> float:
        return waits[min(len(waits) - 1, int(q * (len(waits) - 1) + 0.5))] if waits else 0.0

    return pb.ClassStats(
        latency=latency, calls=c.calls, batches=c.batches, tokens=c.tokens, batch_calls=c.batch_calls,
        wait_p50_us=pct(0.5), wait_p99_us=pct(0.99), refused=c.refused,
    )


def _shared(areas: Areas) -> pb.SharedRegion:
    return pb.SharedRegion(owner_pid=os.getpid(), fd=areas.fd, size=mailbox.Mailbox.total_bytes(areas.box.data_bytes))


def _cuda_region(areas: Areas) -> pb.CudaRegion | None:
    gpu = areas.gpu
    if gpu is None:
        return None
    mem, inp, out = gpu.handles()
    words = bool(areas.words)
    return pb.CudaRegion(
        mem_handle=mem, size=gpu.nbytes, input_ready=inp, output_ready=out, input_word=words, output_word=words,
        words_offset=areas.device_words - gpu.ptr if areas.device_words else 0,
    )


def control_error(code: int, message: str) -> pb.ControlReply:
    return pb.ControlReply(status=pb.Status(code=code, message=message))
