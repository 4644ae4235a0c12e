"""The executor's pure core: validate a call, queue it, and step — gather a batch, run one
GEMM, scatter the rows. No sockets, no threads; transport servers wrap it."""
from __future__ import annotations

import collections
import dataclasses
import logging
import math

import torch

from symbiont.base_executor import runner
from symbiont.base_executor.adapters import AdapterError, AdapterRegistry
from symbiont.base_executor.catalog import EMBEDDING, MLP, SPAN, Unit, UnitTable
from symbiont.base_executor.scheduler import Call, Refused, Scheduler, SchedulerConfig
from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.codec import NAME_OF, TORCH_OF

log = logging.getLogger("base_executor")

OPS = (pb.FORWARD, pb.BACKWARD, pb.FORWARD_NO_BIAS)


class CallError(Exception):
    """A call that cannot be served; becomes a Status on the wire and fails only that call."""

    def __init__(self, code: int, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def status(self) -> pb.Status:
        return pb.Status(code=self.code, message=clip(self.message), retry_after_us=int(self.retry_after_s * 1e6))


def clip(message: str, limit: int = 300) -> str:
    """Status messages travel in ring slots of 508 bytes with the rest of the reply: keep them short."""
    data = message.encode()
    return message if len(data) <= limit else data[: limit - 3].decode(errors="ignore") + "..."


class Unavailable(Exception):
    """The executor can serve no call any more (a rank of it is lost): UNAVAILABLE, never retried."""


@dataclasses.dataclass
class Result:
    call: Call
    y: torch.Tensor | None
    error: CallError | None = None


BATCH_BUCKETS = 7  # batches by calls held: 1, 2, 3-4, 5-8, 9-16, 17-32, 33+


def batch_bucket(calls: int) -> int:
    return min(BATCH_BUCKETS - 1, (calls - 1).bit_length())


@dataclasses.dataclass
class ClassCounters:
    """One latency class's batches (ClassStats on the wire)."""

    calls: int = 0
    batches: int = 0
    tokens: int = 0
    refused: int = 0
    batch_calls: list = dataclasses.field(default_factory=lambda: [0] * BATCH_BUCKETS)


@dataclasses.dataclass
class Counters:
    calls: int = 0
    batches: int = 0
    tokens: int = 0
    errors: int = 0
    graph_replays: int = 0  # lone calls run as a replay of a CUDA graph (graphs.py), captures included
    graph_captures: int = 0
    native_calls: int = 0  # served by a tenant's native lane (transports/local_calls.py), counted in the others too
    per_unit: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_unit_batches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_unit_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    flops: float = 0.0  # model FLOPs of the calls served
    refused: int = 0  # calls answered RETRY_LATER or OVER_BUDGET
    adapter_calls: int = 0  # calls that named a hosted adapter
    classes: dict = dataclasses.field(default_factory=lambda: {pb.TRAINING: ClassCounters(), pb.INFERENCE: ClassCounters()})
    per_tenant_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_tenant_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_tenant_refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class RowSpanDeltas:
    """The hosted adapters of a batch of span calls, each on its calls' rows (runner.run's
    span_deltas): `rows` [(first row, end row, adapters.SpanDelta)]."""

    def __init__(self, rows: list):
        self.rows = rows

    def o(self, a: torch.Tensor, base: torch.Tensor) -> None:
        for first, end, delta in self.rows:
            if delta.o is not None:
                delta.o.add_to(pb.FORWARD, a[first:end], base[first:end])

    def qkv(self, n1: torch.Tensor, q: torch.Tensor) -> None:
        for first, end, delta in self.rows:
            if delta.qkv is not None:
                delta.qkv.add_to(pb.FORWARD, n1[first:end], q[first:end])


def span_deltas(calls: list[Call]) -> RowSpanDeltas | None:
    """The hosted adapters of a batch of span calls (runner.run); None where none of them names
    one, or for calls of any other unit."""
    if calls[0].unit.kind != SPAN:
        return None
    found, start = [], 0
    for c in calls:
        if c.adapter is not None and c.tokens:
            found.append((start, start + c.tokens, c.adapter))
        start += c.tokens
    return RowSpanDeltas(found) if found else None


def add_adapters(calls: list[Call], x: torch.Tensor, y: torch.Tensor) -> None:
    """Each call's hosted adapter on its own rows of a batch, y its result for x (one call run
    alone too, graphs.py); the calls naming one adapter get it in one pass over their rows
    together (the provider's adapter named by many tenants). A span's are added inside it
    (span_deltas)."""
    if calls[0].unit.kind == SPAN:
        return
    rows: dict[int, tuple[object, list[tuple[int, int]]]] = {}  # id(delta) -> (delta, its calls' rows [a, b))
    start = 0
    for c in calls:
        if c.adapter is not None and c.tokens:
            rows.setdefault(id(c.adapter), (c.adapter, []))[1].append((start, start + c.tokens))
        start += c.tokens
    for delta, spans in rows.values():
        if len(spans) == 1:
            (a, b), = spans
            delta.add_to(calls[0].op, x[a:b], y[a:b])
            continue
        idx = torch.cat([torch.arange(a, b, device=x.device) for a, b in spans])
        ys = y.index_select(0, idx)
        delta.add_to(calls[0].op, x.index_select(0, idx), ys)
        y.index_copy_(0, idx, ys)


class ExecutorCore:
    def __init__(self, table: UnitTable, dtype: torch.dtype, device: torch.device, config: SchedulerConfig):
        self.table = table
        self.dtype = dtype
        self.device = device
        self.scheduler = Scheduler(config)
        self.counters = Counters()
        self.tp = None  # a TensorParallel (--placement tensor): each batch runs over every rank
        self.adapters = AdapterRegistry(table, device)
        self.orchestrator = None  # an adapters.MergeOrchestrator (serve --merge auto)
        self._ids_stream = None  # a GPU executor's stream for checking embedding ids (checked_ids)
        self.before_batch = None  # a transport's look at each batch popped, before it runs (where it runs)

    def _gemm(self, unit: Unit, op: int, x: torch.Tensor, exact: bool, out: torch.Tensor | None = None,
              span_deltas: RowSpanDeltas | None = None) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.run(unit, op, x, out)
        return runner.run(unit, op, x, exact, out, span_deltas)

    # ---- validation -------------------------------------------------------

    def check(self, unit_id: str, op: int, dtype_enum: int, shape) -> tuple[Unit, tuple[int, ...], tuple[int, ...], torch.dtype]:
        """Validates a call's header. Returns (unit, input shape as [tokens, d] or [tokens],
        full output shape, input dtype); raises CallError naming what is wrong."""
        unit = self.table.get(unit_id)
        if unit is None:
            raise CallError(pb.UNKNOWN_UNIT, f"unit {unit_id!r} is not served by this executor ({len(self.table)} units)")
        if op not in OPS:
            raise CallError(pb.INVALID_ARGUMENT, f"unknown op {op}; expected one of FORWARD, BACKWARD, FORWARD_NO_BIAS")
        shape = tuple(int(d) for d in shape)
        if not shape or any(d < 0 for d in shape):
            raise CallError(pb.INVALID_ARGUMENT, f"shape {list(shape)} must have at least one dimension and no negative sizes")
        dtype = TORCH_OF.get(dtype_enum)
        if unit.kind == EMBEDDING:
            if op != pb.FORWARD:
                raise CallError(pb.INVALID_ARGUMENT, f"embedding unit {unit_id!r} supports FORWARD only (ids carry no gradient)")
            if dtype is not torch.int64:
                raise CallError(pb.DTYPE_MISMATCH, f"embedding unit {unit_id!r} takes int64 ids, got {NAME_OF.get(dtype, dtype_enum)}")
            return unit, (math.prod(shape),), shape + (unit.out_features,), dtype
        if dtype is not self.dtype:
            raise CallError(
                pb.DTYPE_MISMATCH,
                f"unit {unit_id!r} is served in {NAME_OF[self.dtype]}, got {NAME_OF.get(dtype, f'dtype enum {dtype_enum}')}",
            )
        d_in, d_out = (unit.out_features, unit.in_features) if op == pb.BACKWARD else (unit.in_features, unit.out_features)
        what = "grad_y" if op == pb.BACKWARD else "x"
        if unit.kind == SPAN and op != pb.FORWARD:
            raise CallError(pb.INVALID_ARGUMENT, f"span unit {unit_id!r} supports FORWARD only (inference: a tenant whose "
                            "gradients are recorded calls the layer's units)")
        if unit.kind == MLP:
            if op == pb.FORWARD_NO_BIAS:
                raise CallError(pb.INVALID_ARGUMENT, f"MLP unit {unit_id!r} supports FORWARD and BACKWARD only")
            if op == pb.BACKWARD:  # the input again beside grad_y: the block is recomputed here
                d_in, what = unit.in_features + unit.out_features, "[x, grad_y]"
        if shape[-1] != d_in:
            raise CallError(
                pb.SHAPE_MISMATCH,
                f"{pb.Op.Name(op)} of {unit_id!r} needs {what} with last dimension {d_in}, got shape {list(shape)}",
            )
        return unit, (math.prod(shape[:-1]), d_in), shape[:-1] + (d_out,), dtype

    def checked_ids(self, unit: Unit, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """An embedding call's ids, checked to lie in the unit's rows, as a tensor on this executor's
        device that the caller cannot rewrite any more (a copy of x unless `owned`); CallError else.

        Ids in host memory are checked on the host, then sent to the GPU without waiting for it. Ids
        in GPU memory are copied and checked on a stream of their own: reading their bounds waits
        for that copy alone, not for every tenant's work queued on the data loop's stream (a
        decoding tenant's every token starts with such a call); the current stream waits for it."""
        if x.device.type == "cpu":
            if self.device.type == "cuda":
                ids = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                ids.copy_(x)
            else:
                ids = x if owned else x.clone()
            self._check_bounds(unit, ids)
            return ids.to(self.device, non_blocking=True) if self.device.type == "cuda" else ids
        if self._ids_stream is None:
            self._ids_stream = torch.cuda.Stream(x.device)
        side, current = self._ids_stream, torch.cuda.current_stream(x.device)
        if owned:  # (made on the current stream)
            side.wait_stream(current)
            ids = x
            ids.record_stream(side)
        with torch.cuda.stream(side):
            if not owned:  # (a tenant's mailbox whose input is in: nothing on our streams to wait for)
                ids = torch.empty_like(x)  # (of the side stream's memory: no earlier use of it is still queued)
                ids.copy_(x)
                ids.record_stream(current)
            bounds = torch.empty(2, dtype=ids.dtype, pin_memory=True)
            if ids.numel():  # (read on the side stream, behind the copy: a read on another stream could come first)
                bounds.copy_(torch.stack(torch.aminmax(ids.view(-1))), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()  # (this stream's work alone)
        self._check_bounds(unit, ids, bounds)
        current.wait_stream(side)
        return ids

    @staticmethod
    def _check_bounds(unit: Unit, ids: torch.Tensor, bounds: torch.Tensor | None = None) -> None:
        """bounds: [lowest, highest] of the ids, in host memory (else read from ids, on the host)."""
        if not ids.numel():
            return
        low, high = (bounds if bounds is not None else torch.stack(torch.aminmax(ids.view(-1)))).tolist()
        message = codec.ids_out_of_range(unit.id, unit.in_features, low, high)
        if message is not None:
            raise CallError(pb.INVALID_ARGUMENT, message)

    def merge_stats(self) -> dict:
        """StatsReply's merged-mode fields."""
        o, merged = self.orchestrator, self.adapters.merged
        if o is None:
            return {}
        return dict(merged_adapter=merged.adapter.name if merged is not None else "", merge_switches=o.switches,
                    merge_switch_ms=o.last_switch_s * 1e3, merged_bytes=merged.nbytes if merged is not None else 0,
                    merged_tokens=o.merged_tokens)

    def adapted(self, tenant: int, adapter: int, unit: Unit) -> tuple[Unit, object, int]:
        """What a call of `tenant` naming hosted adapter `adapter` (0: none) at `unit` computes:
        (the unit, or the adapter's merged copy of it; the delta to add, or None; the merge's epoch
        when it is a merged copy, else 0). A sharded executor hosts none (serve refuses them)."""
        try:
            return self.adapters.resolve(tenant, adapter, unit)
        except AdapterError as e:
            raise CallError(e.code, str(e)) from None

    # ---- queue and run ----------------------------------------------------

    def submit(self, call: Call) -> None:
        """Queues `call`; CallError(RETRY_LATER) when the scheduler refuses it (quotas, saturation),
        CallError(OVER_BUDGET) when it would wait past its latency budget."""
        try:
            self.scheduler.submit(call)
        except Refused as e:
            k = self.counters
            k.refused += 1
            k.classes[call.latency].refused += 1
            k.per_tenant_refused[call.tenant] += 1
            raise CallError(e.code, str(e), e.retry_after_s) from None

    def step(self, now: float, can_grow: bool | set = True, attached: int = 0) -> list[Result]:
        """Runs at most one batch; [] when nothing is due."""
        calls = self.scheduler.pop_batch(now, can_grow, attached)
        if not calls:
            return []
        if self.before_batch is not None:
            self.before_batch(calls)
        if self.scheduler.config.exact:
            groups = [[c] for c in calls]
        else:  # (calls of a merged adapter compute with its copy of the unit: a GEMM of their own)
            by_unit: dict[int, list[Call]] = {}
            for c in calls:
                by_unit.setdefault(id(c.unit), []).append(c)
            groups = list(by_unit.values())
        results = [r for group in groups for r in self._run(group)]
        served = [r.call for r in results if r.error is None]
        if served:
            self._count(served)
        return results

    def warm_up(self, stream) -> None:
        """Runs the GEMM primitives of runner.run once on `stream` (a GPU executor) and waits."""
        a = torch.zeros(8, 8, dtype=self.dtype, device=self.device)
        prev = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(stream)
        try:
            torch.addmm(a[0], a, a.t(), out=torch.mm(a, a.t()))
            stream.synchronize()
        finally:
            torch.cuda.set_stream(prev)

    def run_now(self, call: Call) -> list[Result]:
        """Runs one call at once, outside the queues (a call no other could join)."""
        results = self._run([call])
        if results[0].error is None:
            self._count([call])
        return results

    def _run(self, calls: list[Call]) -> list[Result]:
        """One GEMM over the calls' rows, split back per call."""
        exact = self.scheduler.config.exact
        try:
            for c in calls:
                if c.before is not None:  # (a transport's GPU wait for its input, on this stream)
                    c.before()
            if len(calls) == 1:  # straight into the tenant's output mailbox when it offers one
                c = calls[0]
                if c.graphs is not None:
                    return [Result(c, c.graphs.run(c, exact))]
                y = self._gemm(c.unit, c.op, c.x, exact, c.out, span_deltas(calls))
                add_adapters(calls, c.x, y)
                return [Result(c, y.view(c.out_shape))]
            x = torch.cat([c.x for c in calls])  # [tokens, d_in]
            y = self._gemm(calls[0].unit, calls[0].op, x, exact, None, span_deltas(calls))
            add_adapters(calls, x, y)
        except Exception as e:  # never lose the others' calls to one bad one: retry each alone
            if len(calls) > 1 and not isinstance(e, Unavailable):
                return [r for c in calls for r in self._run([c])]
            return self._fail(calls, e)
        results, start = [], 0
        for c in calls:
            results.append(Result(c, y[start : start + c.tokens].view(c.out_shape)))
            start += c.tokens
        return results

    def _fail(self, calls: list[Call], e: Exception) -> list[Result]:
        log.exception("running %s failed", calls[0].unit.id)
        self.counters.errors += len(calls)
        code = pb.UNAVAILABLE if isinstance(e, Unavailable) else pb.INTERNAL
        err = CallError(code, f"{type(e).__name__}: {e}")
        return [Result(c, None, err) for c in calls]

    def _count(self, calls: list[Call]) -> None:
        c0 = calls[0]
        latency = pb.INFERENCE if any(c.latency == pb.INFERENCE for c in calls) else pb.TRAINING
        self.count(c0.unit, c0.op, len(calls), 1, sum(c.tokens for c in calls), latency)
        for c in calls:
            self.counters.per_tenant_calls[c.tenant] += 1
            self.counters.per_tenant_tokens[c.tenant] += c.tokens
            if c.adapter_id:
                self.count_adapter(c.adapter_id, 1, c.tokens, bool(c.merge_epoch))

    def count_adapter(self, adapter_id: int, calls: int, tokens: int, merged: bool) -> None:
        """Counts calls served that named hosted adapter `adapter_id` (also those a transport
        served without the core), for the stats and the merge orchestrator."""
        self.counters.adapter_calls += calls
        if self.orchestrator is not None:
            self.orchestrator.note(adapter_id, tokens, merged)

    def count(self, unit: Unit, op: int, calls: int, batches: int, tokens: int, latency: int = pb.TRAINING) -> None:
        """Counts calls served of one unit, `batches` batches of calls // batches calls each (also
        those a transport served without the core)."""
        k = self.counters
        k.calls += calls
        k.batches += batches
        k.tokens += tokens
        k.per_unit[unit.id] += calls
        k.per_unit_batches[unit.id] += batches
        k.per_unit_tokens[unit.id] += tokens
        k.flops += runner.flops(unit, op, tokens)
        cls = k.classes[latency]
        cls.calls += calls
        cls.batches += batches
        cls.tokens += tokens
        if batches:
            cls.batch_calls[batch_bucket(max(1, calls // batches))] += batches
