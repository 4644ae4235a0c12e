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
the core, writes results into mailboxes and rings each tenant's reply doorbell (how a request
becomes a call and a result a reply: local_calls.py). Nothing here blocks on a tenant: a tenant that dies, corrupts
its ring or never reads its replies is detached and its mailbox reclaimed.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import itertools
import logging
import math
import os
import secrets
import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from symbiont.base_executor.core import CallError, ExecutorCore
from symbiont.base_executor.transports.areas import AreaPool, Tenant, owner_alive
from symbiont.base_executor.transports.call_paths import AHEAD, HELD_OWN, HELD_QUEUED, MAILBOX, OWN, QUEUED
from symbiont.base_executor.transports.local_calls import LocalCalls
from symbiont.base_executor.transports.local_control import LocalControl
from symbiont.base_executor.transports.programs import LocalPrograms
from symbiont.base_executor.transports.remote import RemoteTenants
from symbiont.proto import mailbox, urls
from symbiont.proto.cuda_ipc import reached, stream_wait
from symbiont.proto import executor_pb2 as pb
from symbiont.proto._doorbell import Doorbell

log = logging.getLogger("base_executor")

HELD_POLL_S = 5e-6  # how soon a held call's input copy is looked at again


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalServerConfig:
    name: str
    """The NAME of local://NAME."""
    mailbox_bytes: int = 16 << 20
    """Initial data area of a tenant's mailbox."""
    max_mailbox_bytes: int = 1 << 30
    """The most a tenant's data area may grow to; a call needing more is refused."""
    max_tenants: int = 256
    """Attach requests beyond this many tenants (of every transport, attaches in flight counted) are
    refused with RESOURCE_EXHAUSTED."""
    spin_us: int = 20
    """How long the data loop spins on the wake word before sleeping."""
    liveness_interval_s: float = 0.5
    """How often tenant processes are checked for being alive."""
    gpu_waits: bool = True
    """Whether a lone same-GPU tenant's call may be taken before its input copy is done, its GEMM
    queued on the tenant's own stream behind a GPU wait (else such calls wait on the host)."""
    input_timeout_s: float = 30.0
    """How long a same-GPU tenant's input copy may take to finish before the tenant is detached."""
    graph_tokens: int = 2048
    """A same-GPU tenant's call of at most this many tokens is run as a CUDA graph once its unit, op,
    shape and mailbox offsets come again (base_executor/graphs.py); 0: never. The graphs of a
    tenant hold their largest MLP unit's intermediates (~4 intermediate widths per token)."""
    native_serve: bool = True
    """Whether a lone same-GPU tenant's calls that repeat one already run as a CUDA graph on its own
    stream are served natively (proto._stream_ops.ServeLane: no Python per call)."""
    solo_tokens: int = 1
    """A same-GPU call of at least this many tokens is taken at once on its tenant's own stream, as
    a lone tenant's is, even while others could join it: the tenants' streams then overlap on the
    GPU with no host round trip (0: only lone tenants'). The default 1 takes every call so: on an
    H100 with llama-1b, 16 decoding tenants reach 294 tokens/s so against 156 with calls under 256
    tokens batched in Python (benchmarks/RESULTS.md, S3); a batch only pays once its GEMMs save more
    GPU time than the batching costs the data loop."""

    ids_on_host: bool = False
    """Whether a same-GPU tenant's embedding ids are checked on the host before their lookup (a
    host synchronisation in the data loop, every tenant's, at each decoding token's start; its
    calls are then queued, never taken on its stream) instead of looked up clamped on the GPU and
    checked by the tenant's transport (client/transports/ids.py). For comparisons."""

    gpu_batches: bool = False
    """Whether a same-GPU call that is not taken at once on its tenant's own stream (see
    solo_tokens) is queued for a batch before its input is in, the batch's stream waiting on the
    GPU for every member's input (else it waits on the host until its input is in, then queues).
    Tenants whose hosts run ahead of their GPUs then meet in batches (the scheduler's catching up),
    with no host round trip per call. A batch runs on a waiting member's own stream: a stalled
    tenant holds its batch's other members until it is detached (input_timeout_s)."""

    gang_slots: int = 16
    """Same-GPU tenants whose step programs are the same calls run them together in gangs of up
    to this many (transports/gangs.py): each call one GEMM over every taking-part tenant's rows;
    0: each alone on its own stream. A round waits for its slowest tenant."""
    gang_lanes: int = 4
    """Streams a gang's rounds run on (each its own graph of a round and cuBLAS workspace, warmed
    at start): rounds of tenants that did not come together run at once on different lanes; while
    every lane is busy, runs gather into the next round."""
    gang_priority: int = 0
    """The CUDA stream priority of the gangs' lanes (lower is higher: -1 and below ask the GPU to
    schedule a round's kernels ahead of the tenants' queued ones; clamped to the device's range).
    Every round is on the critical path of all its tenants. 0: the default priority."""
    spin_warps: int = 1
    """Warps of each gang round's word waits (kernels/gang_words.py SPIN_WARPS): fewer spin with
    fewer loads of host memory (one: 1.36x the tokens/s of four at S3 N = 16, session 52)."""
    device_words: bool = False
    """Same-GPU tenants' step program words in their device regions too (proto/mailbox.py
    DEVICE_WORDS): the GPU's waits on them look at device memory, not across PCIe, and at the host
    words every so often for a release (not measured yet)."""
    spin_nap_ns: int = 0
    """Nanoseconds each gang round's word wait sleeps between its looks (kernels/gang_words.py
    SPIN_NAP_NS; 0: none)."""
    gang_spans: str = "fused"
    """How a gang's round computes a layer span: "fused" with its elementwise work in two kernels
    (runner.span_fused: 7 a call; within float rounding, like every ganged result; S3 N = 16 at
    1.72x eager spans' tokens/s, session 50), "eager" with the ops runner._span uses (~36). An
    executor with exact (batch-invariant) results computes them eagerly."""
    gang_wait_us: int = 2000
    """How long a gang's round waits for the tenants of its last round to ask for their next run
    (the first asks at once) before it runs with those that did."""

    def __post_init__(self):
        urls.parse(f"local://{self.name}")
        if self.gang_slots < 0 or self.gang_wait_us < 0 or self.gang_lanes < 1:
            raise ValueError(f"need gang_slots >= 0, gang_lanes >= 1, gang_wait_us >= 0, got {self.gang_slots}, "
                             f"{self.gang_lanes}, {self.gang_wait_us}")
        if self.gang_spans not in ("eager", "fused"):
            raise ValueError(f"gang_spans must be 'eager' or 'fused', got {self.gang_spans!r}")
        if self.solo_tokens < 0:
            raise ValueError(f"solo_tokens must be >= 0 (0: off), got {self.solo_tokens}")
        if self.graph_tokens < 0:
            raise ValueError(f"graph_tokens must be >= 0 (0: no graphs), got {self.graph_tokens}")
        if not 0 < self.mailbox_bytes <= self.max_mailbox_bytes:
            raise ValueError(
                f"need 0 < mailbox_bytes ({self.mailbox_bytes}) <= max_mailbox_bytes ({self.max_mailbox_bytes})"
            )


class LocalServer(LocalControl, LocalCalls, LocalPrograms, RemoteTenants):
    def __init__(self, core: ExecutorCore, catalog: pb.CatalogReply, skeleton: pb.SkeletonReply, config: LocalServerConfig):
        self.core = core
        self.catalog = catalog
        self.skeleton = skeleton
        self.config = config
        self.endpoint = urls.control_endpoint(config.name)
        self.lock = threading.RLock()  # a call run while draining delivers under it too
        self.bound = threading.Event()  # set once serve() has bound its address and on_bound() returned
        self.tenants: dict[int, Tenant] = {}
        self._init_remote()  # tenants of other transports (gRPC), served by the same data loop
        # detached tenants' and outgrown data areas are released by the data loop between
        # batches (never under a running batch; the scheduler is only ever touched by that thread)
        self.areas = AreaPool(config.name, core.device, device_words=config.device_words and core.device.type == "cuda")
        self._stream = None  # the data loop's CUDA stream, on a GPU executor
        self._capture_stream = None  # where graphs of calls on it are captured (base_executor/graphs.py)
        self._gang_streams: list = []  # gangs.LaneStream: where gangs' rounds run (transports/gangs.py), on a GPU executor
        self._gang_setup = None  # the stream gangs' tables are written on
        self._gangs: list = []
        self._gangs_retired: list = []  # gangs kept until their rounds queued are done
        self._gang_failed: set = set()  # keys of gangs whose capture failed (their programs run alone)
        self._native_failed = False  # a lane could not be taught a call: no native serving from then on
        self._batch_waited = None  # the event marking the end of a batch that waits for a tenant's input (_wait_input)
        self._batch_on = None  # the stream such a batch runs on (_pick_stream), while it does
        if config.gpu_batches:
            core.before_batch = self._pick_stream
        self._next_id = 1
        self._attaching = 0  # local attaches between their two turns of the lock (counted against max_tenants)
        self.wake_fd, self._wake_mem = mailbox.create_region(f"symbiont-{config.name}-wake", mailbox.WAKE_BYTES)
        self.wake = Doorbell(self._wake_mem, 0)
        self.started = time.monotonic()
        self.provider_token = secrets.token_hex(16)  # the provider's own control requests (base_executor/provider.py)
        self.stopping = threading.Event()
        self._control_done = threading.Event()
        self._row_norms: dict[str, list[float]] = {}  # unit -> its rows' squared norms, once asked (DoRA)
        self._norms_stream = None  # where they are computed, on a GPU executor
        # how calls were taken (NATIVE, OWN, ...), and the data loop's rounds and time at work (not
        # waiting for a wake): where a call's host time goes (stats, and the log when serving ends)
        self.paths: collections.Counter = collections.Counter()
        self.loop_rounds = 0
        self.loop_busy_s = 0.0

    # ---- lifecycle ----------------------------------------------------------

    def serve(self, on_bound=None) -> None:
        """Serves until stop(); then finishes every call already received and returns.
        on_bound(): called once the address is bound, before any request is answered."""
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
        token_path = urls.provider_token_path(self.config.name)
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.provider_token)
        if on_bound is not None:
            on_bound()
        self.bound.set()  # (other transports' servers answer from now on too)
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
                for r in list(self.remote.values()):
                    self.detach_remote(r, "executor shutting down")
            self._release_retired()  # (every gang lane's stream has passed its rounds)
            self._gangs, self._gangs_retired = [], []  # (their graphs and adapters' tensors, while the CUDA context lives)
            self.areas.close()
            self.core.adapters.clear()
            self.core.scheduler.drop(lambda c: True)
            gc.collect()  # (graphs and calls that held adapters' weights, while the CUDA context lives)
            for gone in (path, token_path):
                try:
                    os.unlink(gone)
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
            if self.config.graph_tokens:
                # warmed now (its cuBLAS workspaces exist before a capture uses them), while no
                # stream of ours waits for a tenant's input: the warm-up synchronises our GPU,
                # which later would wait behind such a stream
                self._capture_stream = torch.cuda.Stream(self.core.device)
                self.core.warm_up(self._capture_stream)
                self._start_gangs()
        next_liveness = time.monotonic() + self.config.liveness_interval_s
        woke = time.monotonic()
        while True:
            self.loop_rounds += 1
            seq = self.wake.seq()
            stopping = self.stopping.is_set()
            if self.areas.has_retired() and not self._gpu_waits():  # freeing memory may wait for every stream of our GPU
                self._release_retired()
            with self.lock:
                tenants = list(self.tenants.values())
                # (a tenant with nothing in its ring and no call held has nothing to drain: looking
                # costs ~1 us, draining it ~5 us of Python and a GIL release in its lane)
                got = sum(self._drain_safely(t, stopping) for t in tenants
                          if t.held is not None or t.box.requests.pending() or t.areas.program_jobs or t.areas.wants_warm)
            if self._gangs or self._gangs_retired:
                with self.lock:
                    got += self._launch_gangs(time.monotonic(), stopping)
            got += self._drain_remote(stopping)
            with self.lock:  # (gRPC threads attach and detach remote tenants)
                remote = list(self.remote.values())
            attached = len(tenants) + len(remote)
            ran = False
            while self.core.scheduler.waiting_tenants():  # (nothing queued: nothing to run, no company to look for)
                now = time.monotonic()
                can_grow = False if stopping else self._company(tenants, remote, now)[0]
                results = []
                try:
                    results = self.core.step(now, can_grow, attached)
                    if results:
                        self._deliver(results)  # (on the stream the batch ran on: _pick_stream)
                finally:
                    self._batch_ran()
                if not results:
                    break
                ran = True
            if stopping and self.core.scheduler.pending() == 0:
                self._fold_lanes()
                self.loop_busy_s += time.monotonic() - woke
                log.info("drained; %d calls served", self.core.counters.calls)
                log.info("calls taken: %s; data loop: %d rounds, at work %.1f s of %.1f",
                         ", ".join(f"{k} {v}" for k, v in sorted(self.paths.items())), self.loop_rounds,
                         self.loop_busy_s, time.monotonic() - self.started)
                return
            now = time.monotonic()
            if now >= next_liveness:
                self._check_liveness()
                next_liveness = now + self.config.liveness_interval_s
            orchestrator = self.core.orchestrator
            if orchestrator is not None and (orchestrator.due(now) or self.core.adapters.dropped_merge):
                self._orchestrate(now)
            if self.core.adapters.needs_eviction() and not self._gpu_waits():
                self._evict_adapters()
            if ran or got:
                continue
            deadline = self.core.scheduler.next_deadline()
            if deadline is not None:  # (no one may join past the company's window: run then)
                deadline = min(deadline, max(self._company(tenants, remote, now)[1], now))
            until = min(next_liveness, deadline) if deadline is not None else next_liveness
            due = self._gangs_due(now) if self._gangs else None
            if due is not None:
                until = min(until, due)
            if any(t.held for t in tenants):  # an input copy is running on the GPU: poll it soon
                until = min(until, time.monotonic() + HELD_POLL_S)
            self.loop_busy_s += time.monotonic() - woke
            self.wake.wait(seq, self.config.spin_us, max(0, int((until - time.monotonic()) * 1e6)))
            woke = time.monotonic()

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
        if t.areas.wants_warm or t.areas.dropped:
            self._tend_programs(t)
        if t.areas.program_jobs:  # (before its calls: the tenant waits for the definition's reply)
            self._capture_programs(t)
        while self.tenants.get(t.id) is t:  # an error reply may have detached it
            if t.areas.gang_run:  # (its later calls wait for its gang's round)
                return n
            if t.areas.lane is not None and t.held is None and not stopping and self._lane_may_serve(t):
                n += self._serve_lane(t)  # up to the first call it does not know, which we take next
            if t.held is not None:
                req, since = t.held
                # (in or not, its input: on its own stream once nothing of t is queued, as a fresh
                # call would be; else a tenant whose GPU keeps up has every later call held too.
                # Stopping, one whose input is in is answered UNAVAILABLE below, as before)
                arrived = self._input_in(t, req)
                if (not stopping or not arrived) and self._run_waiting(t, req, HELD_OWN):
                    t.held = None
                    continue
                if req.program:  # (held until t's queued calls have run; stopping: answered)
                    if not stopping:
                        return n
                    t.held = None
                    self._run_program(t, req, True)
                    continue
                if not arrived:
                    if time.monotonic() - since > self.config.input_timeout_s:
                        self._reclaim(t, f"its input copy did not finish within {self.config.input_timeout_s:.0f} s")
                    return n
                way = HELD_QUEUED
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
                if req.program:  # a step program's run (transports/programs.py): held behind t's queued calls
                    if stopping or t.gpu is None:  # (answered: shutting down, or no such program)
                        self._run_program(t, req, stopping)
                    elif not self._run_waiting(t, req, OWN):
                        t.held = (req, time.monotonic())
                    continue
                self._away_from_gangs(t)
                if self.core.scheduler.config.convoys and self.core.table.get(req.unit) is not None:
                    self.core.scheduler.note_call(t.id, (req.unit, req.op))  # (a valid unit's: bad ones teach nothing)
                way = MAILBOX if t.gpu is None else QUEUED
                if t.gpu is not None and not stopping:
                    if self._run_waiting(t, req, OWN):
                        continue
                    if not self._input_in(t, req):
                        if self._queue_ahead(t, req):
                            continue
                        log.debug("call %d of tenant %d held for its input (input_seq %d)", req.call_id, t.id, req.input_seq)
                        t.held = (req, time.monotonic())
                        continue
            if stopping:
                self._reply_error(t, req.call_id, CallError(pb.UNAVAILABLE, "executor is shutting down"))
                continue
            try:
                self.core.submit(self._to_call(t, req))
                self.paths[way] += 1
            except CallError as e:
                self.core.counters.errors += 1
                self._reply_error(t, req.call_id, e)
        return n

    def _input_in(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Whether a same-GPU call's input copy has finished."""
        if req.input_seq and t.areas.words:
            return reached(t.box.input_word(), req.input_seq)
        return t.gpu.input_ready.query()

    def _run_waiting(self, t: Tenant, req: pb.CallRequest, way: str) -> bool:
        """Runs a same-GPU call at once on t's own stream, behind a GPU wait for its input word
        (which passes at once when the copy is done), when nothing would join it in a batch anyway
        (every other tenant already has a call in), or when it is too big to gain from a batch
        (`solo_tokens`) and no earlier call of t is queued. The host never waits for the tenant's GPU
        work, and a tenant whose copy never ends stalls only its own stream. A call run as a graph
        replay there teaches t's native lane its header (_learn). False when the call must go
        the scheduler's way instead (held first while its input is not in). `way`: what
        self.paths counts it as, once run (OWN, HELD_OWN)."""
        areas = t.areas
        if req.program:  # (its calls are its own: it needs only t's earlier calls run)
            if self.core.scheduler.waiting(t.id):
                return False
            self._run_program(t, req, False)
            return True
        if not self._gpu_may_wait(t, req):
            return False
        if not (self._alone(t, (req.unit, req.op)) or self._solo(t, req)):
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
        if log.isEnabledFor(logging.DEBUG) and not self._input_in(t, req):
            log.debug("call %d of tenant %d taken before its input is in: the GPU waits for it", req.call_id, t.id)
        self._gpu_wait(t, stream, req.input_seq)
        call.tag.stream = stream
        if call.graphs is not None:
            call.graphs = self._graphs(areas, own=True)
        torch.cuda.set_stream(stream)  # (torch.cuda.stream() costs ~17 us of host time more)
        try:
            results = self.core.run_now(call)
            self._deliver(results)  # (which writes the output word first, on this stream)
        finally:
            torch.cuda.set_stream(self._stream)
        self.paths[way] += 1
        if self.config.native_serve and not self._native_failed:
            try:
                self._learn(t, req, call, results[0])
            except Exception as e:  # the calls are served from Python as before
                self._native_failed = True
                log.warning("native serving off: teaching a lane a call failed (%s: %s)", type(e).__name__, e)
        return True

    def _gpu_may_wait(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Whether a stream of ours may wait on the GPU for this same-GPU call's input (the tenant's
        own stream is set up for it, and its input is not embedding ids to be checked on the host)."""
        if not (self.config.gpu_waits and req.input_seq and t.areas.stream is not None):
            return False
        unit = self.core.table.get(req.unit)  # (an unknown unit's call is answered from the host)
        return unit is not None and not self._ids_on_host(unit, area_on_gpu=True)

    def _gpu_wait(self, t: Tenant, stream, seq: int, waited=None) -> None:
        """Queues on `stream` a wait for t's input `seq`, and notes it in t's areas (until `waited`,
        an event recorded after it, when `stream` is not t's own). The stall clock starts with a
        wait on an idle stream and stays while a stuck stream keeps getting calls."""
        areas = t.areas
        if not areas.waiting():
            t.waiting_since = time.monotonic()
        stream_wait(stream.cuda_stream, areas.words, seq)
        areas.await_input(seq, waited)  # (releasing it releases any before)

    def _queue_ahead(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Queues a same-GPU call whose input is not in yet for a batch (gpu_batches): its batch's
        stream waits on the GPU for the input (_wait_input). False when it must be held on the host
        instead (no GPU waits)."""
        # (warm: its batches run on a stream of its own, _pick_stream)
        if not (self.config.gpu_batches and t.areas.warm and self._gpu_may_wait(t, req)):
            return False
        try:
            call = self._to_call(t, req)
            call.before = functools.partial(self._wait_input, t, call.tag.area, req.input_seq)
            self.core.submit(call)
            self.paths[AHEAD] += 1
        except CallError as e:
            self.core.counters.errors += 1
            self._reply_error(t, req.call_id, e)
        return True

    def _pick_stream(self, calls: list) -> None:
        """core.before_batch (gpu_batches): a batch holding a call queued before its input was in
        runs on that call's tenant's own stream, not the data loop's, so that a wait for an input
        there holds only the tenants of the batch (whose next calls follow from its results anyway),
        never everyone's batches behind it. A lone call replays its graphs of that stream."""
        for c in calls:
            areas = c.tag.tenant.areas if c.before is not None else None
            if areas is None or areas.stream is None or not areas.warm:  # (warm: cuBLAS's first GEMM on a stream synchronises our GPU)
                continue
            stream = areas.stream
            for m in calls:
                if not m.tag.remote:  # (a remote call's result is handed over behind an event on this stream)
                    m.tag.stream = stream
                m.graphs = None  # (the data loop's graphs run on its stream only)
            if len(calls) == 1 and c.out is not None:
                c.graphs = self._graphs(areas, own=True)
            self._batch_on = stream
            torch.cuda.set_stream(stream)
            return

    def _wait_input(self, t: Tenant, area, seq: int) -> None:
        """As a batch holding t's call runs (on the stream _pick_stream chose): that stream waits
        on the GPU for the call's input, unless it is in already. The wait is over once the event
        recorded after the batch (_batch_ran) has passed. A tenant detached or regrown since is not
        waited for (its result goes nowhere: _deliver)."""
        if self.tenants.get(t.id) is not t or t.area is not area or reached(t.box.input_word(), seq):
            return
        if self._batch_waited is None:
            self._batch_waited = torch.cuda.Event()
        self._gpu_wait(t, self._batch_on or self._stream, seq, self._batch_waited)

    def _batch_ran(self) -> None:
        """After core.step: marks the end of a batch that waited for inputs, back on our stream."""
        stream = self._batch_on or self._stream
        if self._batch_waited is not None:
            self._batch_waited.record(stream)
            self._batch_waited = None
        if self._batch_on is not None:
            torch.cuda.set_stream(self._stream)
            self._batch_on = None

    def _company(self, tenants: list[Tenant], remote: list, now: float) -> tuple[bool | set, float]:
        """Which queues may still get company in their batch (True: any; a set of (unit, op)s;
        False: none), and until when (with convoys: until the first of those tenants' windows ends,
        when the loop looks again).

        Under lockstep, any while some attached tenant has no call queued. Otherwise only a tenant
        with no call queued that called or got a result lately may send a call soon enough to
        join: its window is the scheduler's longest wait after the later of the two; and only at
        the queues it is expected at (the scheduler's convoys). Tenants idle for longer, those
        expected elsewhere, and under layer placement those working at another rank's layers, are
        waited for by no one."""
        sched = self.core.scheduler
        if sched.config.policy == "lockstep":
            return (True, math.inf) if sched.waiting_tenants() < len(tenants) + len(remote) else (False, 0.0)
        window = sched.config.max_wait_us * 1e-6
        if not sched.config.convoys:
            last = max((max(o.last_call, o.last_reply) for o in itertools.chain(tenants, remote) if not sched.waiting(o.id)),
                       default=0.0)
            until = last + window if last else 0.0
            return until > now, until
        grow, until, heads = set(), math.inf, None
        for o in itertools.chain(tenants, remote):
            last = max(o.last_call, o.last_reply)
            if not last or last + window <= now or sched.waiting(o.id):
                continue
            held = getattr(o, "held", None)  # (a call held for its input is its next one)
            expected = frozenset({(held[0].unit, held[0].op)}) if held is not None else sched.expected(o.id)
            if expected is None:
                grow = True
            else:
                heads = sched.head_keys() if heads is None else heads
                keys = heads.intersection(expected)
                if not keys:
                    continue
                if grow is not True:
                    grow |= keys
            until = min(until, last + window)  # (the first window to end: the loop looks again then)
        return (grow, until) if grow else (False, 0.0)

    def _alone(self, t: Tenant, key: tuple | None = None) -> bool:
        """Whether t's next call (at `key`, the (unit, op); None: wherever t is expected) would run
        alone: no call of t is queued, and no other tenant may send one soon enough to join it."""
        if self.core.scheduler.waiting(t.id):
            # an earlier call of t is queued: its GEMM must be on the GPU before anything waits for
            # an input the tenant's GPU makes only after that GEMM's output (else a synchronising
            # CUDA call of ours, run meanwhile, would wait forever)
            return False
        if self.core.scheduler.config.policy == "lockstep":  # every attached tenant may join, however long it takes
            return len(self.tenants) + len(self.remote) == 1
        keys = None  # (anywhere: without convoys, where t goes does not matter)
        if self.core.scheduler.config.convoys:
            keys = {key} if key is not None else self.core.scheduler.expected(t.id)
        return not any(self._may_join(o, t, keys) for o in self.tenants.values())

    def _lane_may_serve(self, t: Tenant) -> bool:
        """Whether t's native lane may serve now: while t is alone, or at any time when every call
        the lane knows is a solo call (_solo) and no earlier call of t is queued."""
        if t.areas.lane_small:
            return self._alone(t)
        return bool(self.config.solo_tokens) and not self.core.scheduler.waiting(t.id)

    def _solo(self, t: Tenant, req: pb.CallRequest) -> bool:
        """Whether t's call is big enough to run on its own stream whoever else could join it (and
        no earlier call of t is queued: see _alone)."""
        solo = self.config.solo_tokens
        if not solo or self.core.scheduler.waiting(t.id) or len(req.shape) < 2:
            return False
        return math.prod(req.shape[:-1]) >= solo

    def _may_join(self, o: Tenant, t: Tenant, keys) -> bool:
        """Whether tenant o may send a call soon enough to share a batch with t's next (at one of
        `keys`, the (unit, op)s; None: anywhere): it has none in, it called within the longest wait
        the scheduler gives a call, and it is expected at one of them (or where is not known)."""
        sched = self.core.scheduler
        if o is t or o.held is not None or sched.waiting(o.id):
            return False
        if time.monotonic() - o.last_call >= sched.config.max_wait_us * 1e-6:
            return False
        expected = sched.expected(o.id) if sched.config.convoys else None
        return expected is None or keys is None or not expected.isdisjoint(keys)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        with self.lock:
            for t in list(self.tenants.values()):
                if not owner_alive(t.owner):
                    self._reclaim(t, f"process {t.pid} is gone", release=True)
                elif t.areas.waiting() and now - t.waiting_since > self.config.input_timeout_s:
                    if not self._holds_its_round(t):  # (another member holds its gang round: that one goes)
                        continue
                    self._reclaim(t, f"its input copy did not finish within {self.config.input_timeout_s:.0f} s", release=True)
            self.core.scheduler.forget_others(set(self.tenants) | set(self.remote))  # (detached ones)
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
        self.core.adapters.drop_owner(t.id)
        self._leave_gangs(t.areas, None)
        for job in t.areas.program_jobs:  # (a definition handed over and not captured: its control request answers now)
            job.reply = pb.ControlReply(status=pb.Status(code=pb.NOT_ATTACHED, message=f"tenant {t.id} was detached: {why}"))
            job.done.set()
        t.areas.program_jobs = []
        if release:
            t.areas.release_wait()
        t.box.mark_detached()
        self._fold_lane(t.areas)
        self.areas.retire(t.areas, t.owner)
        self.wake.ring()
        log.info("tenant %d (%s, pid %d) detached: %s", t.id, t.name, t.pid, why)

    def _release_retired(self) -> None:
        """Data loop only, between batches: drops retired areas' queued calls, releases them."""

        def drop_calls(area) -> None:
            dropped = self.core.scheduler.drop(lambda c: c.tag.area is area)
            if dropped:
                log.info("%d queued calls on a released mailbox dropped", dropped)

        for lane in self._gang_streams:  # (a gang round queued may read a retired mailbox; no live tenant's is waited on now)
            while not lane.stream.query():
                self.areas.any_waiting()  # (which releases retired areas' words again: each queued run sets one back)
                time.sleep(1e-4)
        self.areas.release_retired(drop_calls)

