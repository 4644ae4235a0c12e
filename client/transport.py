"""The tenant's side of a transport: one small interface every data plane implements.

A Transport is attached once (one tenant identity, one mailbox), then carries calls. The base
class validates inputs and turns wire statuses into exceptions; a backend implements the raw
control round trip and the raw call. Same-GPU CUDA IPC, NCCL and gRPC fit behind the same
three methods without the shims or the executor's scheduler changing.
"""
from __future__ import annotations

import abc
import itertools
import math
import threading

import torch

from symbiont.client.errors import ExecutorUnavailableError, InvalidCallError, NotAttachedError, raise_for_status
from symbiont.proto import codec, urls
from symbiont.proto import executor_pb2 as pb


def adapted_unit(unit: str, adapter: int) -> str:
    """What a shim passes as `unit` to call a unit with hosted adapter `adapter` (0: none): the
    transports keep it apart from the unit's plain calls (their plans, their names in errors)."""
    return f"{unit}@{adapter}" if adapter else unit


class Transport(abc.ABC):
    def __deepcopy__(self, memo):
        return self  # (a copied model calls over the same connection: one tenant)

    def __init__(self, url: str):
        self.url = url
        self.tenant_id = 0
        self.token = ""
        self.device = torch.device("cpu")
        self.area_device: torch.device | None = None  # the executor's GPU, when the data area is there
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one call in flight per tenant
        self.budget_us = 0  # every call's latency budget (connect(..., latency_budget_ms=)); 0: none
        self.embedding_rows: dict[str, int] = {}  # a GPU tenant's: the served embeddings' rows (client/transports/ids.py)

    # ---- backend --------------------------------------------------------------

    @abc.abstractmethod
    def _control(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        """One control round trip; raises ExecutorUnavailableError when the executor does not answer."""

    @abc.abstractmethod
    def _attached(self, reply: pb.AttachReply) -> None:
        """Sets up the data plane from the attach reply (map mailboxes, open streams)."""

    @abc.abstractmethod
    def _call(self, unit: str, op: int, x: torch.Tensor, out_shape: tuple[int, ...], out_dtype: torch.dtype, latency: int, take=None):
        """Carries one call (under the lock) and returns the result as a fresh tensor; raises on a
        non-OK status. x is the caller's tensor, as given (any strides; it may require grad).
        take: None, or a function given the result in place (valid only during the call) whose
        return value, fresh tensors made from it, is returned instead."""

    def _confirm(self) -> None:
        """Backends whose calls may return before their reply: waits for every reply (see confirm)."""

    @abc.abstractmethod
    def _teardown(self) -> None:
        """Releases the data plane (after detach, or when the executor is gone)."""

    # ---- interface --------------------------------------------------------------

    def control(self, kind: str, message, timeout_s: float = 60.0) -> pb.ControlReply:
        """Sends one control request (`kind` is the oneof field) and returns the OK reply."""
        req = pb.ControlRequest(tenant_id=self.tenant_id, token=self.token)
        getattr(req, kind).CopyFrom(message)
        reply = self._control(req, timeout_s)
        raise_for_status(reply.status, f"{kind} on {self.url}")
        return reply

    def attach(
        self, tenant_name: str, latency: int = pb.TRAINING, mailbox_bytes: int = 0, device: torch.device | None = None
    ) -> pb.AttachReply:
        """Becomes a tenant. `device` is where this tenant's tensors live. When it is the
        executor's GPU, or another GPU of the host that can reach it as a peer, the data plane is
        device memory on the executor's GPU shared by CUDA IPC (`area_device`); otherwise host
        shared memory."""
        import os

        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        uuid = self._area_uuid() if self.device.type == "cuda" else ""
        request = pb.AttachRequest(
            tenant_name=tenant_name, pid=os.getpid(), default_latency=latency, mailbox_bytes=mailbox_bytes, device_uuid=uuid
        )
        self._extend_attach(request)
        reply = self.control("attach", request).attach
        self.tenant_id, self.token = reply.tenant_id, reply.token
        self._attached(reply)
        return reply

    def _extend_attach(self, request: pb.AttachRequest) -> None:
        """What a backend adds to its attach request (the gRPC transport: a collective plane)."""

    def _area_uuid(self) -> str:
        """A GPU tenant: the executor's GPU's uuid when our data area can live there (the executor's
        own GPU or a peer of ours; sets area_device), else ""."""
        from symbiont.proto.cuda_ipc import mappable_device

        catalog = self.control("catalog", pb.CatalogRequest()).catalog
        served_on = catalog.device_uuid
        self.area_device = mappable_device(served_on, self.device)
        self.embedding_rows = {u.id: u.in_features for u in catalog.units if u.kind == "embedding"}
        return served_on if self.area_device is not None else ""

    @property
    def is_attached(self) -> bool:
        return self.tenant_id != 0

    def call(self, unit: str, op: int, x: torch.Tensor, out_shape: tuple[int, ...], out_dtype: torch.dtype, latency: int, take=None):
        """Runs `op` of `unit` on x at the executor; returns a tensor of out_shape/out_dtype on x's
        device, or what take(result) makes of it (see _call): one copy less when take copies anyway
        (take only reads its argument, which may be the transport's memory). Once this returns, x's
        memory may be reused: the call has read it (a GPU tensor's in its stream's order)."""
        if not isinstance(x, torch.Tensor):
            raise InvalidCallError(f"unit {unit!r} takes a tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise InvalidCallError(f"unit {unit!r} takes a tensor with at least one dimension, got a scalar")
        codec.dtype_enum(x.dtype)  # (raises for a dtype no unit takes)
        if math.prod(out_shape) == 0:
            y = torch.empty(out_shape, dtype=out_dtype, device=x.device)
            return y if take is None else take(y)
        with self._lock:
            return self._call(unit, op, x, tuple(out_shape), out_dtype, latency, take)

    def _request(self, unit: str, op: int, x: torch.Tensor, latency: int, call_id: int = 0) -> pb.CallRequest:
        """The CallRequest of a call of `op` of `unit` on x (call_id 0: the fields every such call shares).
        `unit` may name a hosted adapter as UNIT@ID (adapted_unit)."""
        unit, _, adapter = unit.partition("@")
        return pb.CallRequest(call_id=call_id, unit=unit, op=op, dtype=codec.dtype_enum(x.dtype), shape=list(x.shape), latency=latency,
                              adapter=int(adapter or 0), budget_us=self.budget_us)

    def confirm(self) -> None:
        """Waits until the executor has answered every call made so far and raises the first
        failure among them. A same-GPU call returns before its reply (its result is ordered on
        the GPU), so a failure may surface only at a later call or here; virtualize() confirms
        at the end of every forward and backward pass."""
        with self._lock:
            self._confirm()

    def close(self) -> None:
        """Detaches (the executor frees the mailbox) and releases local resources. Idempotent;
        waits for a call in flight on another thread."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for _ in range(1000):  # (the calls' results are in before the mailbox goes)
            try:
                self._confirm()
                break
            except (ExecutorUnavailableError, NotAttachedError):
                break
            except Exception:  # a failed call's error: it is the caller's no more; the rest still come
                continue
        if self.tenant_id:
            try:
                self.control("detach", pb.DetachRequest(), timeout_s=5.0)
            except Exception:
                pass
            self.tenant_id, self.token = 0, ""
        self._teardown()


def open_transport(url: str, **options) -> Transport:
    """The transport of url's scheme. options: gRPC's token, tls_dir, tenant, reconnect_s and plane (see connect)."""
    scheme, name = urls.parse(url)
    if scheme == "grpc":
        from symbiont.client.transports.grpc import GrpcTransport

        return GrpcTransport(url, name, **options)
    if any(v is not None for v in options.values()):
        raise ValueError(f"{url}: {sorted(k for k, v in options.items() if v is not None)} apply to grpc:// addresses only")
    if scheme == "local":
        from symbiont.client.transports.local import LocalTransport

        return LocalTransport(url, name)
    raise ValueError(f"no transport for {url!r}")
