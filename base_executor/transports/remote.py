"""Tenants whose calls reach the data loop from another thread (the gRPC server's): they have no
mailbox; a call arrives as a core Call whose input is a host tensor, and its Result goes back
through the RemoteDelivery in its tag. A mixin of LocalServer (transports/local.py), whose data
loop is the only thread that touches the scheduler: other threads only append to the inbox."""
from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import time

import torch

from symbiont.base_executor.core import CallError, Result
from symbiont.base_executor.scheduler import Call
from symbiont.base_executor.transports.call_paths import REMOTE
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")


@dataclasses.dataclass(slots=True, eq=False)
class RemoteTenant:
    id: int
    name: str
    token: str  # the session token of its AttachReply
    peer: str  # where it connects from, for the log
    credential_name: str  # the provider's name for its credential ("" when none is required)
    latency: int = pb.TRAINING
    plane: object = None  # its collective plane (transports/collective.py's TenantPlane), when it asked for one
    last_call: float = 0.0  # when its last call was taken from the inbox
    last_reply: float = 0.0  # when its last result was handed back


@dataclasses.dataclass(slots=True, eq=False)
class RemoteDelivery:
    """Where a remote call's result goes (its Call.tag): `done(error, y, event)` runs on the data
    loop's thread; y is a host tensor, ready once `event` (a CUDA event, or None) has passed."""

    tenant: RemoteTenant
    done: object
    area: object = None  # (no mailbox: LocalServer._release_retired's test never matches)
    stream: object = None
    remote: bool = True
    plane: object = None  # the call came on the tenant's collective plane: its result goes there (no host copy)


class RemoteTenants:
    """Remote tenants of LocalServer; `self` is the LocalServer."""

    def _init_remote(self) -> None:
        self.remote: dict[int, RemoteTenant] = {}
        self._inbox: collections.deque[Call] = collections.deque()  # appended by other threads
        self._remote_gone: collections.deque[int] = collections.deque()  # ids whose queued calls go

    def attach_remote(self, name: str, peer: str, credential_name: str, latency: int) -> RemoteTenant:
        """A new remote tenant; CallError(RESOURCE_EXHAUSTED) when the executor is full."""
        with self.lock:
            if self.stopping.is_set():  # (after the server's look: a tenant added now would never be detached)
                raise CallError(pb.UNAVAILABLE, "executor is shutting down")
            if (full := self._full()) is not None:
                raise CallError(pb.RESOURCE_EXHAUSTED, full)
            tid = self._next_id
            self._next_id += 1
            t = self.remote[tid] = RemoteTenant(tid, name or f"tenant-{tid}", secrets.token_hex(16), peer, credential_name, latency)
        log.info("tenant %d (%s, %s) attached over gRPC%s", tid, t.name, peer,
                 f" with the credential of {credential_name!r}" if credential_name else "")
        return t

    def _full(self) -> str | None:
        """Why one more tenant may not attach, or None (caller holds the lock): every transport's
        tenants count, and the local attaches making their mailboxes."""
        n = len(self.tenants) + len(self.remote) + self._attaching
        if n < self.config.max_tenants:
            return None
        return f"executor full: {n} tenants attached or attaching (max {self.config.max_tenants}, --max-tenants)"

    def remote_tenant(self, tenant_id: int, token: str) -> RemoteTenant | None:
        t = self.remote.get(tenant_id)
        return t if t is not None and secrets.compare_digest(t.token, token) else None

    def detach_remote(self, t: RemoteTenant, why: str) -> None:
        with self.lock:
            if self.remote.pop(t.id, None) is None:
                return
            self.core.adapters.drop_owner(t.id)
            self._remote_gone.append(t.id)
        if t.plane is not None:
            t.plane.close()
        self.wake.ring()
        log.info("tenant %d (%s, %s) detached: %s", t.id, t.name, t.peer, why)

    def submit_remote(self, call: Call) -> None:
        """Queues a remote tenant's call for the data loop (any thread)."""
        self._inbox.append(call)
        self.wake.ring()

    def _drain_remote(self, stopping: bool) -> int:
        """Data loop: drops the queued calls of remote tenants gone, moves the inbox into the core."""
        while self._remote_gone:
            tid = self._remote_gone.popleft()
            dropped = self.core.scheduler.drop(lambda c, tid=tid: c.tenant == tid)
            if dropped:
                log.info("%d queued calls of tenant %d dropped", dropped, tid)
        n = 0
        while self._inbox:
            call = self._inbox.popleft()
            n += 1
            sender = self.remote.get(call.tenant)
            if sender is None:
                continue
            try:
                if stopping:
                    raise CallError(pb.UNAVAILABLE, "executor is shutting down")
                if call.x.device != self.core.device:
                    call.x = call.x.to(self.core.device)
                elif call.x.is_cuda:  # (a collective plane's bytes, received on its own stream)
                    call.x.record_stream(torch.cuda.current_stream(self.core.device))
                call.arrived = sender.last_call = time.monotonic()
                if self.core.scheduler.config.convoys:
                    self.core.scheduler.note_call(call.tenant, (call.unit.id, call.op))
                self.core.submit(call)
                self.paths[REMOTE] += 1
            except CallError as e:
                self.core.counters.errors += 1
                call.tag.done(e, None, None)
        return n

    def _deliver_remote(self, results: list[Result]) -> None:
        """Data loop: hands remote calls' results to their senders (a GPU result copied to the host
        behind an event the sender waits for)."""
        now = time.monotonic()
        for r in results:
            d = r.call.tag
            sender = self.remote.get(r.call.tenant)
            if sender is not None:
                sender.last_reply = now
            if r.error is not None:
                d.done(r.error, None, None)
                continue
            y, event = r.y, None
            if d.plane is not None:  # (its plane's thread sends it, behind this event)
                if y.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
                d.done(None, y, event)
                continue
            if y.is_cuda:
                host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
                host.copy_(y, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                y = host
            d.done(None, y, event)

    def _remote_stats(self, k) -> list[pb.TenantStats]:
        sched = self.core.scheduler
        return [
            pb.TenantStats(tenant_id=t.id, name=t.name, pid=0, placement=f"remote, {t.plane.backend} plane" if t.plane else "remote", calls=k.per_tenant_calls[t.id],
                           tokens=k.per_tenant_tokens[t.id], queued_calls=sched.queued(t.id), refused=k.per_tenant_refused[t.id])
            for t in list(self.remote.values())
        ]
