"""The NCCL data plane of a tenant on another GPU of the executor's host: a two-rank NCCL group
per tenant (the executor rank 0, the tenant rank 1), made at attach from a TCPStore that the
executor opens on a free local port; no global world, tenants come and go.

A call's input travels by the tenant's send and the executor's recv, its result back by the
executor's send and the tenant's recv, each ordered on the GPUs against the streams that make
and use the tensors: no host waits for a GPU. Both sides exchange one element first, which
makes the communicator (NCCL sets it up at a group's first operation, blocking both hosts
until both are there), before any call.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import torch

CONNECT_TIMEOUT_S = 60.0
EXECUTOR, TENANT = 0, 1


def _group(store, rank: int, device: torch.device):
    import torch.distributed as dist

    # One tenant's group timing out must never take the executor down: no watchdog aborts.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(days=365)  # a call may wait on its peer as long as the peer lives
    with torch.cuda.device(device):
        return dist.ProcessGroupNCCL(dist.PrefixStore("symbiont", store), rank, 2, opts)


class Plane:
    """One side of a tenant's NCCL group. send/recv queue on the NCCL stream behind the current
    stream's work; recv makes the current stream wait for the data."""

    def __init__(self, store, rank: int, device: torch.device):
        self.store = store
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.group = _group(store, rank, device)
        self._ready = threading.Event()
        self.failed = ""

    @classmethod
    def listen(cls, device: torch.device) -> "Plane":
        """The executor's side: a store on a free port (self.port), connected by connect_async."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        return cls(store, EXECUTOR, device)

    @classmethod
    def join(cls, port: int, device: torch.device) -> "Plane":
        """The tenant's side; connects before it returns."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False,
                              timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        plane = cls(store, TENANT, device)
        plane._connect()
        return plane

    @property
    def port(self) -> int:
        return self.store.port

    def connect_async(self) -> None:
        """The executor's side: makes the communicator on a thread of its own (it blocks until the
        tenant joins); ready() says when it is done, `failed` why it failed."""
        threading.Thread(target=self._connect, name="nccl-connect", daemon=True).start()

    def ready(self) -> bool:
        return self._ready.is_set()

    def _connect(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            one = torch.zeros(1, device=self.device)
            work = self.group.send([one], self.peer, 0) if self.rank == TENANT else self.group.recv([one], self.peer, 0)
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the NCCL group's first exchange took more than {CONNECT_TIMEOUT_S:.0f} s")
                time.sleep(1e-3)
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            if self.rank == TENANT:
                raise
        self._ready.set()

    def send(self, x: torch.Tensor) -> None:
        self.group.send([x], self.peer, 0)

    def recv(self, y: torch.Tensor) -> None:
        """Fills y; the current stream waits for it."""
        self.group.recv([y], self.peer, 0).wait()

    def abort(self) -> None:
        """Ends the group: a send or recv still waiting for the peer on the GPU ends too."""
        for name in ("abort", "_abort", "shutdown"):
            f = getattr(self.group, name, None)
            if f is not None:
                try:
                    f()
                except Exception:
                    continue
                return
