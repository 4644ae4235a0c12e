"""The collective data plane of a gRPC tenant (`connect(url, plane="nccl")`): a call's tensor bytes
travel by torch.distributed send/recv in a group of two ranks that belongs to this one tenant
(rank 0 the executor, rank 1 the tenant), made at attach and gone at detach: no global world, so
tenants come and go. NCCL carries the bytes between two GPUs (the tenant's GPU is not a peer of the
executor's: another host on the GPU network); gloo carries them between CPU tensors (a CPU
executor: CI's path through the same code). The call's header and reply stay on the gRPC stream.

Rendezvous: the executor runs one TCPStore (its master); each tenant's group lives under a prefix
of it that names the tenant and a random nonce, told only in the (TLS) attach reply.

Protocol, per call: the tenant sends the header with `on_plane`, then posts its send of the input's
bytes; the executor receives exactly the header's bytes (so the two ranks stay in step even when
the call is refused), runs the call, replies with `on_plane` and posts its send of the result; the
tenant posts its receive only after that OK reply. One call at a time per tenant, so both ranks
post their operations in the same order.

NCCL connects two ranks lazily, at their first transfer in each direction, and that connection
blocks the posting thread until the other rank posts its half. So nothing here posts an operation
where the other rank's half waits for a message this thread has still to send: the header goes
before the bytes, the reply before the result's bytes (posted from the plane's own thread, never
the data loop), and the warm-up connects both directions at attach.
"""
from __future__ import annotations

import datetime

import torch

EXECUTOR, TENANT = 0, 1
NCCL, GLOO = "nccl", "gloo"


def backend_for(device: torch.device) -> str:
    """The backend of a plane to an executor on `device`: NCCL between GPUs, gloo on CPUs."""
    return NCCL if device.type == "cuda" else GLOO


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat uint8 tensor (a view when t is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class Pair:
    """One end of a tenant's two-rank group. `device`: where this end's plane tensors live (the
    GPU for NCCL, the CPU for gloo)."""

    def __init__(self, store, prefix: str, rank: int, backend: str, device: torch.device, timeout_s: float):
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("this torch has no torch.distributed: no collective plane")
        self.rank, self.peer, self.backend, self.device = rank, 1 - rank, backend, torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        group_store = dist.PrefixStore(prefix, store)
        if backend == NCCL:
            if self.device.type != "cuda":
                raise ValueError(f"an NCCL plane carries CUDA tensors, not {self.device}")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(group_store, rank, 2, options)
        elif backend == GLOO:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(group_store, rank, 2, timeout)
        else:
            raise ValueError(f"no collective plane over {backend!r} (nccl or gloo)")
        self._last_send = None  # (work, tensor): kept until the next send, so its bytes stay alive

    def send(self, t: torch.Tensor):
        """Posts the send of t's bytes to the other end (on the current stream's order, for NCCL)."""
        data = as_bytes(t)
        work = self.group.send([data], self.peer, 0)
        self._last_send = (work, data)
        return work

    def recv(self, nbytes: int):
        """Posts the receive of nbytes bytes; returns (the uint8 buffer, its work). For NCCL, the
        work's wait() makes the current stream wait; for gloo it blocks until the bytes are in."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, self.group.recv([buf], self.peer, 0)

    def wait_host(self, work, stream=None) -> None:
        """Blocks this thread until `work` has finished (NCCL: on `stream`, a side stream made to
        wait for it, then synchronised; the caller's other streams never wait)."""
        if self.backend == GLOO:
            work.wait()
            return
        with torch.cuda.stream(stream):
            work.wait()
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        with torch.cuda.stream(stream):
            work.wait()  # (raises now if NCCL's watchdog failed the work: its buffer holds no bytes of the peer's)

    def warm_up(self, stream=None) -> None:
        """One byte each way: makes the communicator and connects both directions (NCCL does both
        lazily) before any call, so no call pays for them."""
        one = torch.ones(1, dtype=torch.uint8, device=self.device)
        for sending in ((True, False) if self.rank == TENANT else (False, True)):
            work = self.send(one) if sending else self.recv(1)[1]
            self.wait_host(work, stream)

    def close(self) -> None:
        """Ends the group; an operation still posted (the other end died) is aborted."""
        group, self.group = getattr(self, "group", None), None
        self._last_send = None
        if group is None:
            return
        for how in ("abort", "shutdown"):
            try:
                getattr(group, how)()
                return
            except Exception:  # (an older torch, or already torn down)
                continue
