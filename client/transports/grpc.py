"""gRPC transport (`grpc://HOST:PORT`), tenant side: a tenant on another host.

Control requests are unary `Control` RPCs; the data calls of one attach travel on one
bidirectional `Calls` stream, each call's tensor as raw bytes in `payload` (chunked past
`chunk_bytes`) and its result likewise; every call waits for its reply. A GPU tenant's tensors
are copied to the host and back. When the executor goes away (a restart), a call waits up to
`reconnect_s` for it to answer again, attaches anew (the same model, or ModelMismatchError) and
sends the call again: calls change no state at the executor, so a retried call counts once.
Credentials: `token` (the provider's NAME.token) goes with
every RPC as metadata; with `tls_dir` the channel is mutual TLS with the tenant's certificate
(NAME.pem, NAME.key) and the provider's CA (ca.pem); without it the channel is plaintext and the
executor must serve with --insecure.

Planes: with `plane="nccl"` (or by default, "auto", for a tenant on a GPU that is not the
executor's, when the executor offers it) a call's tensors travel by NCCL send/recv in a two-rank
group of this tenant's (proto/collective.py): GPU to GPU, no host copies; the header and the reply
stay on the stream. An executor on a CPU offers the same plane over gloo (CPU tensors).
`plane="stream"`: the tensors always ride in the stream.
"""
from __future__ import annotations

import contextlib
import datetime
import pathlib
import queue
import threading

import grpc
import torch

from symbiont.client.errors import ExecutorUnavailableError, MalformedMessageError, raise_for_status
from symbiont.client.transport import Transport
from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb

SERVICE = "/symbiont.Executor/"
PLANES = ("auto", "stream", "nccl")
_MESSAGE_LIMIT = codec.grpc_message_limit()
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class GrpcTransport(Transport):
    def __init__(self, url: str, address: str, *, token: str = "", tls_dir: str | None = None, tenant: str | None = None,
                 reconnect_s: float | None = None, plane: str | None = None):
        super().__init__(url)
        self.address = address
        self.plane = plane or "auto"
        if self.plane not in PLANES:
            raise ValueError(f"plane must be one of {', '.join(PLANES)}, got {plane!r}")
        self._pair = None  # our end of the collective plane (proto/collective.py's Pair), when there is one
        self.reconnect_s = 60.0 if reconnect_s is None else reconnect_s
        self._attach_args = None  # (tenant_name, latency, mailbox_bytes, device) of the first attach
        self._served = None  # what the executor served then: (model, unit fingerprints)
        self.credential = token or ""
        options = [("grpc.max_receive_message_length", _MESSAGE_LIMIT), ("grpc.max_send_message_length", _MESSAGE_LIMIT),
                   # a restarted executor is found within ~2 s, not grpc's default of up to 2 minutes
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls_dir:
            d = pathlib.Path(tls_dir)
            if tenant is None:
                raise ValueError("tls_dir needs tenant= (the NAME of NAME.pem, NAME.key, NAME.token there)")
            if not self.credential and (d / f"{tenant}.token").exists():
                self.credential = (d / f"{tenant}.token").read_text().strip()
            creds = grpc.ssl_channel_credentials(
                root_certificates=(d / "ca.pem").read_bytes(),
                private_key=(d / f"{tenant}.key").read_bytes(),
                certificate_chain=(d / f"{tenant}.pem").read_bytes(),
            )
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._control_rpc = self._channel.unary_unary(SERVICE + "Control")
        self._calls_rpc = self._channel.stream_stream(SERVICE + "Calls")
        self._requests: queue.SimpleQueue | None = None
        self._replies = None
        self._stream_lock = threading.Lock()

    def _metadata(self) -> list[tuple[str, str]]:
        return [("credential", self.credential)] if self.credential else []

    def _control(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        if request.WhichOneof("kind") == "attach" and self.credential:
            request.attach.credential = self.credential
            request.attach.pid = 0  # (a pid means nothing on the executor's host)
        try:
            data = self._control_rpc(request.SerializeToString(), timeout=timeout_s, metadata=self._metadata())
        except grpc.RpcError as e:
            raise _unavailable(self.url, e) from None
        try:
            return pb.ControlReply.FromString(data)
        except Exception as e:
            raise MalformedMessageError(f"reply from {self.url} does not parse: {e}") from e

    def attach(self, tenant_name, latency=pb.TRAINING, mailbox_bytes=0, device=None):
        reply = super().attach(tenant_name, latency, mailbox_bytes, device)
        served = self._served_model()
        if self._served is None:
            self._attach_args, self._served = (tenant_name, latency, mailbox_bytes, device), served
        elif served != self._served:
            from symbiont.client.errors import ModelMismatchError

            self.tenant_id = 0
            raise ModelMismatchError(f"{self.url} came back serving another model ({served[0]}) than before ({self._served[0]})")
        return reply

    def _served_model(self):
        catalog = self.control("catalog", pb.CatalogRequest()).catalog
        return catalog.model, tuple(sorted((u.id, u.fingerprint) for u in catalog.units))

    def _reattach(self, why: Exception) -> None:
        """Waits up to reconnect_s for the executor to answer, then attaches anew; raises `why`
        when it does not come back."""
        import time
        import warnings

        deadline = time.monotonic() + self.reconnect_s
        self._close_stream()
        self.tenant_id, self.token = 0, ""
        while True:
            try:
                self.attach(*self._attach_args)
                warnings.warn(f"{self.url}: the executor was gone ({why}); attached again as tenant {self.tenant_id}",
                              RuntimeWarning, stacklevel=3)
                return
            except ExecutorUnavailableError:
                if time.monotonic() > deadline:
                    raise why from None
                time.sleep(0.5)

    def _area_uuid(self) -> str:
        return ""  # (no data area on the executor's GPU from another host)

    def _extend_attach(self, request: pb.AttachRequest) -> None:
        """Asks for a collective plane: plane="nccl", or "auto" for a tenant on a GPU whose executor,
        on another GPU, offers NCCL planes."""
        if self.plane == "stream" or (self.plane == "auto" and self.device.type != "cuda"):
            return
        catalog = self.control("catalog", pb.CatalogRequest()).catalog
        nccl = catalog.collective_plane == "nccl"
        if self.device.type != "cuda":  # (plane="nccl")
            if nccl:
                raise ValueError(f"{self.url}: an NCCL plane carries a GPU tenant's tensors; this tenant is on {self.device}")
        elif self.plane == "auto":
            from symbiont.proto.cuda_ipc import device_uuid

            if not nccl or catalog.device_uuid in ("", device_uuid(self.device)):
                return
        request.plane = "nccl"

    def _attached(self, reply: pb.AttachReply) -> None:
        self._open_stream()
        self._close_pair()
        if reply.HasField("collective"):
            self._pair = self._make_pair(reply.collective)

    def _make_pair(self, info: pb.CollectivePlane):
        """Our end of the plane the executor made for us; None (auto: calls go in the stream) or
        ExecutorUnavailableError (plane="nccl") when it cannot be made."""
        import os

        import torch.distributed as dist

        from symbiont.proto import collective

        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # (a failed plane fails its calls, not this process)
        try:
            store = dist.TCPStore(info.store_host, info.store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=info.timeout_s or 60))
            device = self.device if info.backend == collective.NCCL else torch.device("cpu")
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                pair = collective.Pair(store, info.prefix, collective.TENANT, info.backend, device, info.timeout_s or 60)
                pair.warm_up()
            return pair
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if self.plane == "nccl":
                raise ExecutorUnavailableError(f"{self.url}: the collective plane ({info.backend}) did not come up: {why}") from None
            import warnings

            warnings.warn(f"{self.url}: no collective plane ({why}); tensors go in the call stream", RuntimeWarning, stacklevel=4)
            return None

    def _close_pair(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None

    def _open_stream(self) -> None:
        self._close_stream()
        requests: queue.SimpleQueue = queue.SimpleQueue()
        metadata = [*self._metadata(), ("tenant-id", str(self.tenant_id)), ("token", self.token)]
        self._replies = self._calls_rpc(iter(requests.get, None), metadata=metadata)
        self._requests = requests

    def _close_stream(self) -> None:
        if self._requests is not None:
            self._requests.put(None)  # (ends the request stream: the executor detaches us)
        if self._replies is not None:
            self._replies.cancel()
        self._requests = self._replies = None

    def _call(self, unit, op, x, out_shape, out_dtype, latency, take=None):
        while True:
            try:
                return self._call_once(unit, op, x, out_shape, out_dtype, latency, take)
            except ExecutorUnavailableError as e:
                if not self.reconnect_s or self._attach_args is None:
                    raise
                self._reattach(e)

    def _call_once(self, unit, op, x, out_shape, out_dtype, latency, take=None):
        if self._requests is None:
            if self.tenant_id:  # (its stream ended: a failed plane call) _call attaches again
                raise ExecutorUnavailableError(f"{self.url}: this tenant's call stream ended")
            from symbiont.client.errors import NotAttachedError

            raise NotAttachedError(f"{self.url}: attach first")
        call_id = next(self._ids)
        head = self._request(unit, op, x, latency, call_id)
        if self._pair is not None:
            y = self._plane_call(self._pair, head, unit, op, x)
        else:
            host = x.detach()
            if host.device.type != "cpu":
                host = host.cpu()
            for i, (piece, more) in enumerate(codec.chunks(codec.to_bytes(host), codec.GRPC_CHUNK_BYTES)):
                msg = head if i == 0 else pb.CallRequest(call_id=call_id)
                msg.payload, msg.more = piece, more
                self._requests.put(msg.SerializeToString())
            first, parts = self._reply(call_id, unit, op)
            try:
                # (take copies what it reads: it may read the payload where it lies)
                y = codec.from_bytes(b"".join(parts), first.shape, codec.torch_dtype(first.dtype), copy=take is None)
            except ValueError as e:
                raise MalformedMessageError(f"{self.url}: the result's {e}") from None
        if y.dtype != out_dtype or y.shape != tuple(out_shape):
            raise MalformedMessageError(f"{self.url}: result {tuple(y.shape)} {y.dtype}, expected {tuple(out_shape)} {out_dtype}")
        if y.device != x.device:
            y = y.to(x.device)
        return y if take is None else take(y)

    def _reply(self, call_id: int, unit: str, op: int) -> tuple[pb.CallReply, list[bytes]]:
        """The reply to call `call_id` (its first message, and every message's payload); raises the
        typed error of a refusal, ExecutorUnavailableError when the stream is gone."""
        parts, first = [], None
        try:
            while True:
                reply = pb.CallReply.FromString(next(self._replies))
                if first is None:
                    first = reply
                    raise_for_status(reply.status, f"{pb.Op.Name(op)} of {unit!r} on {self.url}")
                    if reply.call_id != call_id:
                        raise MalformedMessageError(f"{self.url}: reply to call {reply.call_id}, expected {call_id}")
                parts.append(reply.payload)
                if not reply.more:
                    return first, parts
        except grpc.RpcError as e:
            self._requests = self._replies = None
            raise _unavailable(self.url, e) from None
        except StopIteration:
            self._requests = self._replies = None
            raise ExecutorUnavailableError(f"{self.url}: the executor ended this tenant's call stream") from None

    def _plane_call(self, pair, head: pb.CallRequest, unit: str, op: int, x: torch.Tensor) -> torch.Tensor:
        """A call whose tensors go on the collective plane: the header, then its bytes (the executor
        receives as many as it says); after the OK reply, the result's bytes, which our stream waits
        for (NCCL; gloo: this thread). A refusal leaves both ranks in step (the executor took the
        bytes and sends none); anything else (an interrupt, a failed transfer, a reply out of order)
        ends the stream and the plane, so the next call attaches anew (ExecutorUnavailableError:
        `_call` attaches again and makes the call again) instead of reading another call's bytes."""
        from symbiont.client.errors import SymbiontError

        head.on_plane = True
        try:
            self._requests.put(head.SerializeToString())
            pair.send(x.detach().to(pair.device))
            first, _ = self._reply(head.call_id, unit, op)
            return self._receive(pair, first)
        except SymbiontError as e:
            if isinstance(e, (ExecutorUnavailableError, MalformedMessageError)):
                self._break_plane()
            raise
        except BaseException as e:
            self._break_plane()
            if not isinstance(e, Exception):  # (an interrupt: the caller's)
                raise
            raise ExecutorUnavailableError(f"{self.url}: the collective plane failed ({type(e).__name__}: "
                                           f"{str(e).splitlines()[0] if str(e) else ''})") from e

    def _break_plane(self) -> None:
        """Ends the call stream (the executor detaches us) and our end of the plane."""
        self._close_stream()
        self._close_pair()

    def _receive(self, pair, reply: pb.CallReply) -> torch.Tensor:
        """The result of a call on the plane, once its OK reply came: our stream waits for its bytes
        (NCCL; gloo: this thread does)."""
        if not reply.on_plane:
            raise MalformedMessageError(f"{self.url}: a call on the collective plane answered in the stream")
        dtype = codec.torch_dtype(reply.dtype)
        buf, work = pair.recv(codec.nbytes(tuple(reply.shape), dtype))
        work.wait()
        return buf.view(dtype).view(tuple(reply.shape))

    def _teardown(self) -> None:
        self._close_stream()
        self._close_pair()

    def _close(self) -> None:
        super()._close()
        self._channel.close()


def _unavailable(url: str, e: grpc.RpcError) -> Exception:
    code = e.code() if hasattr(e, "code") else None
    from symbiont.client.errors import AuthenticationError

    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{url}: {e.details()}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # (a message over the size limit)
        from symbiont.client.errors import ResourceExhaustedError

        return ResourceExhaustedError(f"{url}: {e.details()}")
    return ExecutorUnavailableError(f"no executor answered at {url} ({code.name if code else 'error'}: "
                                    f"{e.details() if hasattr(e, 'details') else e})")
