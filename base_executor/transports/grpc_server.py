"""gRPC transport server (`grpc://HOST:PORT`): tenants on other hosts.

A `grpc.aio` server on its own thread and event loop. Control requests are the unary `Control`
RPC (the ControlRequest / ControlReply of every transport); a tenant's data calls travel on one
bidirectional `Calls` stream, opened after attach with its session's `tenant-id` and `token` as
metadata. A call's tensor rides in `payload` (raw bytes, the header's dtype and shape; never
pickle), in chunks of at most `chunk_bytes` (`more` on all but the last). Calls go into the same
core as every other transport's (transports/remote.py): the data loop batches them with the
others'.

Security: mutual TLS unless the provider serves with `--insecure`, and a credential (a token the
provider gave the tenant: `base-executor certs`) on every RPC but health. With TLS the client
certificate's common name must be the credential's tenant name. A session (tenant id and
token) can touch only itself, and stats over gRPC show only the caller's own tenant row. Every
refused request is logged with its peer and reason.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import secrets
import threading

import grpc
import torch
from google.protobuf.message import DecodeError

from symbiont.base_executor.core import CallError, clip
from symbiont.base_executor.scheduler import Call
from symbiont.base_executor.transports.local_control import control_error
from symbiont.base_executor.transports.remote import RemoteDelivery, RemoteTenant
from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")
SERVICE = "symbiont.Executor"
_OK = pb.Status(code=pb.OK)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpcServerConfig:
    address: str
    """HOST:PORT to bind (port 0: any free port; the log names the one bound)."""
    tls_dir: str | None = None
    """A folder of `base-executor certs`: ca.pem (the tenants' CA), server.pem, server.key."""
    credentials: dict[str, str] = dataclasses.field(default_factory=dict)
    """token -> tenant name; empty: no credential asked (only with insecure)."""
    insecure: bool = False
    """Serve without TLS (the provider said --insecure)."""
    chunk_bytes: int = codec.GRPC_CHUNK_BYTES
    """The most payload bytes in one message."""
    max_call_bytes: int = 1 << 30
    """The most payload bytes of one call (all its chunks), or bytes of one call on a collective plane."""
    collective_plane: bool = True
    """Offer tenants a collective plane (`connect(url, plane="nccl")`: NCCL on a GPU executor, gloo on a CPU one)."""
    plane_host: str = ""
    """The host name tenants reach the planes' rendezvous at ("": the listen address's host, or this host's name)."""
    plane_port: int = 0
    """The rendezvous port (0: any free port, made at the first plane)."""
    plane_timeout_s: float = 60.0
    """How long a plane's ends wait for each other (its making, a call's bytes)."""

    def __post_init__(self):
        if not self.insecure and not self.tls_dir:
            raise ValueError("a gRPC listener needs --tls-dir (mutual TLS) or an explicit --insecure")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")


def read_credentials(path: str) -> dict[str, str]:
    """A tokens file of `base-executor certs`: one `NAME TOKEN` per line ('#' starts a comment)."""
    out = {}
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'NAME TOKEN', got {line!r}")
        out[parts[1]] = parts[0]
    return out


class GrpcServer:
    """Serves `hub` (the LocalServer that owns the data loop) over gRPC."""

    def __init__(self, hub, config: GrpcServerConfig):
        self.hub = hub
        self.config = config
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpc", daemon=True)
        self.planes = None
        if config.collective_plane:
            from symbiont.base_executor.transports.collective import CollectivePlanes

            host = config.plane_host or config.address.rpartition(":")[0].strip("[]")
            self.planes = CollectivePlanes(hub.core.device, host, config.plane_port, config.plane_timeout_s)

    # ---- lifecycle ----------------------------------------------------------

    def start(self) -> int:
        """Starts serving; returns the bound port."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"gRPC listener on {self.config.address} did not start: {self._error}") from self._error
        return self.port

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # (reported by start())
            self._error = e
            self._ready.set()

    def _credentials(self) -> grpc.ServerCredentials | None:
        if self.config.insecure:
            return None
        d = pathlib.Path(self.config.tls_dir)
        return grpc.ssl_server_credentials(
            [((d / "server.key").read_bytes(), (d / "server.pem").read_bytes())],
            root_certificates=(d / "ca.pem").read_bytes(),
            require_client_auth=True,
        )

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limit = codec.grpc_message_limit(self.config.chunk_bytes)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
        raw = dict(request_deserializer=None, response_serializer=None)  # bytes: a malformed message gets a typed reply
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Control": grpc.unary_unary_rpc_method_handler(self._control_rpc, **raw),
            "Calls": grpc.stream_stream_rpc_method_handler(self._calls_rpc, **raw),
        }),))
        creds = self._credentials()
        if creds is None:
            self.port = server.add_insecure_port(self.config.address)
        else:
            self.port = server.add_secure_port(self.config.address, creds)
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=2)

    # ---- who is asking ----------------------------------------------------------

    def _refuse(self, context, why: str) -> pb.Status:
        log.warning("gRPC request from %s refused: %s", context.peer(), why)
        return pb.Status(code=pb.UNAUTHENTICATED, message=why)

    def _credential_name(self, context, credential: str = "") -> tuple[str | None, pb.Status | None]:
        """The tenant name of the request's credential (metadata `credential`, or `credential` as
        given), checked against the client certificate; (None, status) when refused."""
        if not self.config.credentials:
            return "", None
        token = credential or dict(context.invocation_metadata() or ()).get("credential", "")
        if not token:
            return None, self._refuse(context, "no credential: pass the token the provider gave you (credential=)")
        name = next((n for t, n in self.config.credentials.items() if secrets.compare_digest(t, token)), None)
        if name is None:
            return None, self._refuse(context, "unknown credential")
        if not self.config.insecure:
            cns = [v.decode() for v in (context.auth_context() or {}).get("x509_common_name", [])]
            if name not in cns:
                return None, self._refuse(context, f"the credential of {name!r} came with the certificate of {cns or 'nobody'}")
        return name, None

    # ---- control ----------------------------------------------------------------

    async def _control_rpc(self, data: bytes, context) -> bytes:
        try:
            req = pb.ControlRequest.FromString(data)
        except DecodeError as e:
            log.warning("gRPC control request from %s malformed: %s", context.peer(), e)
            return control_error(pb.MALFORMED, f"control bytes do not parse as ControlRequest: {e}").SerializeToString()
        if not self.hub.bound.is_set():  # (a sharded executor's ranks are not all bound yet: no catalog to give)
            return control_error(pb.UNAVAILABLE, "the executor is starting; try again").SerializeToString()
        try:
            return self._control(req, context).SerializeToString()
        except Exception as e:  # a bug must not kill the control plane
            log.exception("gRPC control request failed")
            return control_error(pb.INTERNAL, clip(f"{type(e).__name__}: {e}")).SerializeToString()

    def _control(self, req: pb.ControlRequest, context) -> pb.ControlReply:
        kind = req.WhichOneof("kind")
        if kind == "health":
            return self.hub._control(req.SerializeToString())
        name, refused = self._credential_name(context, req.attach.credential if kind == "attach" else "")
        if refused is not None:
            return pb.ControlReply(status=refused)
        if kind == "catalog":
            reply = self.hub._control(req.SerializeToString())
            if self.planes is not None and reply.status.code == pb.OK:
                reply.catalog.collective_plane = self.planes.backend
            return reply
        if kind in ("skeleton", "norms"):
            return self.hub._control(req.SerializeToString())
        if kind == "stats":
            reply = self.hub._control(req.SerializeToString())
            own = self.hub.remote_tenant(req.tenant_id, req.token)
            rows = [s for s in reply.stats.tenant_stats if own is not None and s.tenant_id == own.id]
            del reply.stats.tenant_stats[:]
            reply.stats.tenant_stats.extend(rows)  # (a tenant sees only its own row)
            return reply
        if kind == "attach":
            if self.hub.stopping.is_set():
                return control_error(pb.UNAVAILABLE, "executor is shutting down")
            a = req.attach
            if a.plane and a.plane != "nccl":
                return control_error(pb.INVALID_ARGUMENT, f"no {a.plane!r} plane: ask for 'nccl' or none")
            if a.plane and self.planes is None:
                return control_error(pb.UNAVAILABLE, "this executor offers no collective plane (serve without --no-collective-plane)")
            try:
                t = self.hub.attach_remote(a.tenant_name, context.peer(), name, a.default_latency)
            except CallError as e:
                return pb.ControlReply(status=e.status())
            reply = pb.AttachReply(tenant_id=t.id, token=t.token)
            if a.plane:
                try:
                    t.plane, info = self.planes.open(t.id)
                except Exception as e:  # (the rendezvous store could not bind)
                    self.hub.detach_remote(t, f"no collective plane: {e}")
                    return control_error(pb.UNAVAILABLE, f"the collective plane could not be made: {e}")
                reply.collective.CopyFrom(info)
            return pb.ControlReply(status=_OK, attach=reply)
        t = self.hub.remote_tenant(req.tenant_id, req.token)
        if t is None or t.credential_name != name:
            return control_error(pb.NOT_ATTACHED, f"tenant {req.tenant_id} is not attached (never attached, detached, or reclaimed)")
        if kind == "detach":
            self.hub.detach_remote(t, "detach requested")
            return pb.ControlReply(status=_OK)
        if kind == "grow":
            return control_error(pb.INVALID_ARGUMENT, "gRPC tenants have no mailbox to grow")
        if kind in ("host_adapter", "adapters", "remove_adapter"):
            with self.hub.lock:
                return self.hub.adapter_control(t.id, req)
        return control_error(pb.INVALID_ARGUMENT, f"unknown control request {kind}")

    # ---- calls --------------------------------------------------------------------

    async def _calls_rpc(self, requests, context):
        meta = dict(context.invocation_metadata() or ())
        name, refused = self._credential_name(context)
        if refused is not None:
            yield pb.CallReply(status=refused).SerializeToString()
            return
        try:
            tenant_id = int(meta.get("tenant-id", "0"))
        except ValueError:
            tenant_id = 0
        t = self.hub.remote_tenant(tenant_id, meta.get("token", ""))
        if t is None or t.credential_name != name:
            log.warning("gRPC call stream from %s refused: tenant %s is not attached", context.peer(), meta.get("tenant-id"))
            yield pb.CallReply(status=pb.Status(code=pb.NOT_ATTACHED, message=f"tenant {tenant_id} is not attached")).SerializeToString()
            return
        head, parts, size = None, [], 0
        try:
            async for data in requests:
                try:
                    req = pb.CallRequest.FromString(data)
                except DecodeError as e:
                    head, parts, size = None, [], 0
                    yield _call_status(0, pb.MALFORMED, f"call bytes do not parse as CallRequest: {e}")
                    continue
                if head is not None and req.call_id != head.call_id:
                    yield _call_status(head.call_id, pb.MALFORMED, f"call {head.call_id} ended without its last chunk")
                    head, parts, size = None, [], 0
                if head is None:
                    head = req
                size += len(req.payload)
                if size <= self.config.max_call_bytes:
                    parts.append(req.payload)
                if req.more:
                    continue
                payload = b"".join(parts)
                head_, too_big = head, size > self.config.max_call_bytes
                head, parts, size = None, [], 0
                if too_big:
                    yield _call_status(head_.call_id, pb.RESOURCE_EXHAUSTED,
                                       f"call of more than {self.config.max_call_bytes} payload bytes")
                    continue
                try:
                    replies = await self._one_call(t, head_, payload)
                except PlaneBroken as e:
                    log.warning("tenant %d (%s): %s; detached", t.id, t.name, e)
                    yield _call_status(head_.call_id, e.code, f"{e}; this tenant is detached")
                    return
                for chunk in replies:
                    yield chunk
        finally:
            if t.id in self.hub.remote:
                self.hub.detach_remote(t, "its call stream ended")

    async def _one_call(self, t: RemoteTenant, req: pb.CallRequest, payload: bytes) -> list[bytes]:
        loop = self._loop
        if req.on_plane:
            nbytes = self._plane_bytes(t, req, payload)  # (PlaneBroken: the ranks cannot stay in step)
            try:
                payload = await loop.run_in_executor(t.plane.pool, t.plane.receive, nbytes)
            except Exception as e:
                raise PlaneBroken(f"the call's bytes did not come on the collective plane ({e})", pb.UNAVAILABLE) from None
        try:
            call = self._to_call(t, req, payload)
        except CallError as e:
            self.hub.core.counters.errors += 1
            return [pb.CallReply(call_id=req.call_id, status=e.status()).SerializeToString()]
        future = loop.create_future()

        def done(error, y, event):  # (the data loop's thread)
            try:
                loop.call_soon_threadsafe(_resolve, future, (error, y, event))
            except RuntimeError:  # the listener has stopped: nobody waits for it
                pass

        call.tag = RemoteDelivery(t, done, plane=t.plane if req.on_plane else None)
        self.hub.submit_remote(call)
        error, y, event = await future
        if error is not None:
            return [pb.CallReply(call_id=req.call_id, status=error.status()).SerializeToString()]
        if req.on_plane:  # the reply, then (the plane's thread) the result's bytes
            t.plane.pool.submit(t.plane.send, y, event)
            return [pb.CallReply(call_id=req.call_id, status=_OK, dtype=codec.dtype_enum(y.dtype), shape=list(y.shape),
                                 on_plane=True).SerializeToString()]
        if event is not None:
            await loop.run_in_executor(None, event.synchronize)
        head = dict(call_id=req.call_id, status=_OK, dtype=codec.dtype_enum(y.dtype), shape=list(y.shape))
        return [
            pb.CallReply(payload=piece, more=more, **(head if i == 0 else {"call_id": req.call_id})).SerializeToString()
            for i, (piece, more) in enumerate(codec.chunks(codec.to_bytes(y), self.config.chunk_bytes))
        ]

    def _plane_bytes(self, t: RemoteTenant, req: pb.CallRequest, payload: bytes) -> int:
        """How many bytes a call on t's collective plane sends: its header's; PlaneBroken when
        they cannot be known (the two ranks would fall out of step)."""
        if t.plane is None:
            raise PlaneBroken("a call on a collective plane from a tenant that attached without one")
        if payload:
            raise PlaneBroken("a call on a collective plane with a payload too")
        try:
            nbytes = codec.nbytes(tuple(req.shape), codec.torch_dtype(req.dtype))
        except (ValueError, KeyError, TypeError) as e:
            raise PlaneBroken(f"a call on a collective plane whose bytes its header does not say ({e})") from None
        if any(d < 0 for d in req.shape):
            raise PlaneBroken(f"a call on a collective plane of shape {list(req.shape)}")
        if nbytes > self.config.max_call_bytes:
            raise PlaneBroken(f"a call on a collective plane of {nbytes} bytes (at most {self.config.max_call_bytes})",
                              pb.RESOURCE_EXHAUSTED)
        return nbytes

    def _to_call(self, t: RemoteTenant, req: pb.CallRequest, payload) -> Call:
        """payload: the input's bytes, or (a collective plane's) a uint8 tensor of them."""
        core = self.hub.core
        if req.in_offset or req.out_offset or req.input_seq:
            raise CallError(pb.INVALID_ARGUMENT, "gRPC calls carry their tensor in payload: no mailbox offsets or input_seq")
        unit, in_shape, out_shape, dtype = core.check(req.unit, req.op, req.dtype, req.shape)
        try:
            x = payload.view(dtype).view(in_shape) if isinstance(payload, torch.Tensor) else codec.from_bytes(payload, in_shape, dtype)
        except (ValueError, RuntimeError) as e:
            raise CallError(pb.INVALID_ARGUMENT, f"payload of {e} (shape {list(req.shape)})") from None
        if unit.kind == "embedding":
            x = core.checked_ids(unit, x, owned=True)  # (from_bytes and the plane's buffer made x for this call)
        unit, adapter, epoch = core.adapted(t.id, req.adapter, unit)
        return Call(tenant=t.id, call_id=req.call_id, unit=unit, op=req.op, x=x, out_shape=out_shape, latency=req.latency,
                    arrived=0.0, adapter=adapter, adapter_id=req.adapter, merge_epoch=epoch, budget_s=req.budget_us * 1e-6)


class PlaneBroken(Exception):
    """A tenant's collective plane is out of step with its calls: its call stream ends (it is detached)."""

    def __init__(self, message: str, code: int = pb.MALFORMED):
        super().__init__(message)
        self.code = code


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _call_status(call_id: int, code: int, message: str) -> bytes:
    return pb.CallReply(call_id=call_id, status=CallError(code, message).status()).SerializeToString()
