"""The executor's end of gRPC tenants' collective planes (proto/collective.py): one TCPStore for
the rendezvous, and per tenant that asks for one a two-rank group made at attach.

Each plane's own thread receives a call's input (a tenant that never sends its bytes stalls only
itself) and the call reaches the data loop once its bytes are in; after the reply the same thread
posts the result's send, behind an event the data loop recorded after the call's work. The data
loop never makes an NCCL call (NCCL's lazy connection may block the posting thread).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import queue
import secrets
import socket
import threading

import torch

from symbiont.proto import collective
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")


class TenantPlane:
    """One tenant's group, rank 0 of it."""

    def __init__(self, tenant_id: int, device: torch.device, backend: str, timeout_s: float):
        self.tenant_id, self.device, self.backend, self.timeout_s = tenant_id, device, backend, timeout_s
        self.prefix = f"plane/{tenant_id}/{secrets.token_hex(8)}/"
        self.pair: collective.Pair | None = None
        self.ready = threading.Event()  # the group is made and warmed up, or failed (error)
        self.error = ""
        self.closed = False
        # its receives and sends: one thread, so a tenant that never sends its bytes holds up no one
        # else; a daemon, so it never keeps a stopping executor alive (gloo's abort does not wake a receive)
        self.pool = _DaemonWorker(f"plane-{tenant_id}", device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None  # (None: torch.cuda.stream does nothing)

    def open(self, store) -> None:
        """(its pool's thread) Makes the group; the tenant makes its end after the attach reply."""
        try:
            self.pair = collective.Pair(store, self.prefix, collective.EXECUTOR, self.backend, self.device, self.timeout_s)
            self.pair.warm_up(self.side)
            log.info("tenant %d: collective plane (%s) up", self.tenant_id, self.backend)
        except Exception as e:
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("tenant %d: collective plane did not come up: %s", self.tenant_id, self.error)
        finally:
            self.ready.set()

    def receive(self, nbytes: int) -> torch.Tensor:
        """(its pool's thread) The next nbytes bytes the tenant sends, in place on the executor's
        device once this returns."""
        if not self.ready.wait(self.timeout_s) or self.pair is None:
            raise ConnectionError(f"no collective plane ({self.error or 'not up in time'})")
        with torch.cuda.stream(self.side):  # (the buffer belongs to this stream: reused only by our receives)
            buf, work = self.pair.recv(nbytes)
        self.pair.wait_host(work, self.side)
        return buf

    def send(self, y: torch.Tensor, event) -> None:
        """(its pool's thread, after the reply) Posts the result's send, behind `event` (a CUDA event
        recorded after the call's work, or None)."""
        try:
            if self.pair is None:
                raise ConnectionError("no collective plane")
            with torch.cuda.stream(self.side):
                if event is not None:
                    self.side.wait_event(event)
                self.pair.send(y)
        except Exception as e:  # (closed: the tenant left; its receive fails with it)
            log.warning("tenant %d: a result did not go on its collective plane: %s", self.tenant_id, e)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pair is not None:
            self.pair.close()  # (NCCL: aborts a receive still posted; gloo's ends at its timeout, in a daemon thread)
        self.pool.shutdown(wait=False)


class _DaemonWorker(concurrent.futures.Executor):
    """One daemon thread running what is submitted, in order (asyncio's run_in_executor takes it),
    with `device` its current device."""

    def __init__(self, name: str, device: torch.device):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, args=(device,), name=name, daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            future.set_exception(ConnectionError("the collective plane is closed"))
        else:
            self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._jobs.put(None)

    def _run(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)


class CollectivePlanes:
    """The planes of one executor: its store (made at the first plane) and each tenant's group."""

    def __init__(self, device: torch.device, host: str = "", port: int = 0, timeout_s: float = 60.0):
        self.device, self.timeout_s = device, timeout_s
        # a plane's failure (a tenant gone mid-call) aborts its communicator and fails its calls;
        # NCCL's default would end the executor
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.backend = collective.backend_for(device)
        self.host = host if host and host not in ("0.0.0.0", "[::]", "::") else socket.getfqdn()
        self.port = port
        self._store = None
        self._lock = threading.Lock()

    def _the_store(self):
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                self._store = dist.TCPStore("0.0.0.0", self.port, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=self.timeout_s))
                self.port = self._store.port
                log.info("collective planes (%s): rendezvous at %s:%d", self.backend, self.host, self.port)
            return self._store

    def open(self, tenant_id: int) -> tuple[TenantPlane, pb.CollectivePlane]:
        """A new plane for tenant_id, made in its own thread; what the attach reply tells the tenant."""
        store = self._the_store()
        plane = TenantPlane(tenant_id, self.device, self.backend, self.timeout_s)
        plane.pool.submit(plane.open, store)
        return plane, pb.CollectivePlane(store_host=self.host, store_port=self.port, prefix=plane.prefix,
                                         backend=self.backend, timeout_s=self.timeout_s)
