"""The calls of the same-host transport server (`local://NAME`): a request read from a tenant's
ring becomes a core Call (its header checked against the served units and the tenant's data
area), and a Result becomes the tenant's reply: the result in its mailbox, the output word
written on the GPU for a same-GPU tenant, the reply on its ring, its doorbell rung. A mixin of
LocalServer (transports/local.py), which owns the tenants and the data loop."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from symbiont.base_executor.adapters import PROVIDER, merge_bytes
from symbiont.base_executor.core import CallError, Result
from symbiont.base_executor.graphs import CallGraphs
from symbiont.base_executor.scheduler import Call
from symbiont.base_executor.transports.areas import Tenant
from symbiont.base_executor.transports.call_paths import LATE, NATIVE
from symbiont.base_executor.transports.programs import ProgramCounts
from symbiont.proto import codec, mailbox
from symbiont.proto.cuda_ipc import native_ops, reached, stream_write
from symbiont.proto import executor_pb2 as pb


log = logging.getLogger("base_executor")
_OK = pb.Status(code=pb.OK)
MAX_CHECKED = 1024  # call headers remembered as valid per tenant data area (LocalCalls._check)


@dataclasses.dataclass(slots=True, eq=False)
class Delivery:
    """Where a call's result goes (its Call.tag)."""

    tenant: Tenant
    area: object  # the tenant's data area when the call was taken (a grow retires it)
    out_offset: int
    input_seq: int  # written to the mailbox's output word once the result is in place (0: none)
    stream: object = None  # the stream that runs the call; None: the data loop's
    remote = False  # (a class attribute: transports/remote.py's RemoteDelivery says True)


@dataclasses.dataclass(slots=True, eq=False)
class _Told:
    """One tenant's results of a delivery, and how its GPU learns that their results are in."""

    stream: object  # the stream that wrote the results
    seq: int = 0  # the latest input_seq among the calls: written to the output word
    event: bool = False  # some call had no input_seq: output_ready is recorded
    results: list = dataclasses.field(default_factory=list)


ADAPTED = object()  # the first element of the graph key of a call that names a hosted adapter
MERGED = object()  # ... of a call that names the merged adapter at a unit it has a copy of (epoch, adapter, key)


class LocalCalls:
    """Calls and replies of LocalServer; `self` is the LocalServer."""

    def _to_call(self, t: Tenant, req: pb.CallRequest) -> Call:
        if req.payload:
            raise CallError(pb.INVALID_ARGUMENT, "local:// calls carry tensors in the mailbox, not in payload")
        unit, in_shape, out_shape, dtype, key = self._check(t, req)
        out_dtype = self.core.dtype
        area = t.area
        x = area.view(req.in_offset, in_shape, dtype)
        out = graphs = None
        if self._ids_on_host(unit, x.is_cuda):
            x = self.core.checked_ids(unit, x)  # (a copy: the ids checked must be the ids looked up)
        elif x.device != self.core.device:
            x = x.to(self.core.device, non_blocking=bool(t.areas.pinned))  # a copy, DMA when page-locked
        else:  # a call run alone writes straight into the output mailbox
            out = area.view(req.out_offset, (in_shape[0], out_shape[-1]), out_dtype)
            if x.is_cuda:  # (a same-GPU tenant's device mailbox)
                graphs = self._graphs(t.areas, own=False)  # on the data loop's stream, unless _run_waiting moves it
        unit, adapter, epoch = self.core.adapted(t.id, req.adapter, unit)
        if epoch:
            key = (MERGED, epoch, req.adapter, key)  # (its graph reads the merged copy's weight)
        elif adapter is not None:
            key = (ADAPTED, req.adapter, key)  # (its graph holds the adapter's delta: graphs.py)
        return Call(
            tenant=t.id,
            call_id=req.call_id,
            unit=unit,
            op=req.op,
            x=x,
            out_shape=out_shape,
            latency=req.latency,
            arrived=time.monotonic(),
            tag=Delivery(t, area, req.out_offset, req.input_seq),
            out=out,
            graphs=graphs,
            graph_key=key,
            adapter=adapter,
            adapter_id=req.adapter,
            merge_epoch=epoch,
            budget_s=req.budget_us * 1e-6,
        )

    def _ids_on_host(self, unit, area_on_gpu: bool) -> bool:
        """Whether our host checks a call's embedding ids before their lookup (core.checked_ids):
        ids in host memory always, ids in a data area on our GPU only with `serve --ids-on-host`
        (else they are looked up clamped, runner.run, and the tenant's transport checks them)."""
        return unit.kind == "embedding" and (not area_on_gpu or self.config.ids_on_host)

    def _graphs(self, areas, own: bool):
        """The CallGraphs of a same-GPU tenant's calls on its own stream (own) or on the data
        loop's; None when graphs are off."""
        graphs = areas.own_graphs if own else areas.graphs
        if graphs is None and self.config.graph_tokens:
            graphs = CallGraphs(self.core.device, self.config.graph_tokens, self.core.counters, self._capture_stream)
            if own:
                areas.own_graphs = graphs
            else:
                areas.graphs = graphs
        return graphs

    # ---- the native lane: repeats of a lone tenant's graphed calls, no Python per call ------

    def _learn(self, t: Tenant, req: pb.CallRequest, call: Call, result: Result) -> None:
        """After a call of t ran as a graph replay on its own stream (and was delivered): its lane
        serves the calls with its request header from now on (proto._stream_ops.ServeLane)."""
        areas = t.areas
        graph = call.graphs.graph_of(call.graph_key) if call.graphs is not None else None
        if graph is None or result.error is not None or call.graph_key in areas.lane_keys or self.tenants.get(t.id) is not t:
            return
        if self._lane(t, call.graphs) is None:
            return
        header = pb.CallRequest()
        header.CopyFrom(req)
        header.ClearField("call_id")
        header.ClearField("input_seq")  # (what stays is the header the tenant's Lane.send writes first)
        header = header.SerializeToString()
        reply = self._reply(result)
        reply.ClearField("call_id")
        areas.lane_keys[call.graph_key] = header
        areas.lane.learn(header, int(graph.raw_cuda_graph_exec()), reply.SerializeToString(), len(areas.lane_units))
        unit = self.core.table.get(call.unit.id) if call.merge_epoch else call.unit  # (not a merged copy: it goes)
        areas.lane_units.append((unit, call.op, call.tokens, call.latency, t.id, call.adapter_id, call.merge_epoch))
        if call.tokens < self.config.solo_tokens or not self.config.solo_tokens:
            areas.lane_small = True  # it knows a call others could join: it serves only while t is alone

    def _lane(self, t: Tenant, graphs):
        """t's native lane, made at its first use (None where the native module is not built);
        `graphs`: the CallGraphs of t's own stream, whose dropped keys the lane forgets."""
        areas = t.areas
        if areas.lane is None:
            ops = native_ops()
            if ops is None:
                return None
            areas.lane = ops.ServeLane(
                areas.box.mem, mailbox.REQUEST_RING_OFFSET, mailbox.REPLY_RING_OFFSET, mailbox.RING_SLOTS,
                mailbox.RING_SLOT_SIZE, mailbox.REPLY_BELL_OFFSET, areas.stream.cuda_stream, areas.words, areas.out_word,
                self.core.device.index, mailbox.INPUT_WORD_OFFSET,
            )
            if graphs is not None:
                graphs.on_drop = lambda key: self._unlearn(areas, key)
        return areas.lane

    def _unlearn(self, areas, key) -> None:
        header = areas.lane_keys.pop(key, None)
        if header is not None:
            areas.lane.forget(header)

    def _orchestrate(self, now: float) -> None:
        """Data loop, between batches, at the end of a merge window (serve --merge auto): merges,
        unmerges or switches the merged adapter as the orchestrator decides. The switch waits until
        no stream of ours waits for a tenant's input (it synchronises our GPU: no replay still
        queued may read a copy that goes)."""
        registry, orchestrator = self.core.adapters, self.core.orchestrator
        self._fold_lanes()  # (the lanes' calls count too)
        target = None
        if orchestrator.due(now):

            def fits(adapter_id: int) -> bool:
                adapter = registry.get(adapter_id)
                return adapter is not None and merge_bytes(self.core.table, adapter) <= orchestrator.max_bytes

            merged = registry.merged_adapter
            target = orchestrator.decide(now, merged.id if merged is not None else 0, fits)
        if (target is None and not registry.dropped_merge) or self._gpu_waits():
            return
        with self.lock:
            self._sync_gpu()
            registry.dropped_merge = False
            if target is not None:
                old, merged = registry.unmerge(), None
                try:
                    if target and registry.get(target) is not None:  # (removed meanwhile: nothing to merge)
                        merged = registry.merge(target)
                except Exception as e:  # (out of memory for the copies, ...): stay unmerged, serve on
                    log.warning("merged mode: merging adapter %d failed (%s: %s); calls compute it per call",
                                target, type(e).__name__, e)
                orchestrator.switched(merged.switch_s if merged is not None else 0.0)
                log.info("merged mode: %s -> %s%s", old.adapter.name if old is not None else "none",
                         merged.adapter.name if merged is not None else "none",
                         f" ({merged.nbytes / 2**20:.1f} MiB of copies in {merged.switch_s * 1e3:.1f} ms)" if merged is not None else "")
            self._forget_merged()

    def _evict_adapters(self) -> None:
        """Data loop, between batches, no stream of ours waiting on a tenant: pages out the least
        recently used hosted adapters past the pool's budget; the graphs and lanes that computed
        them forget those calls (our GPU synchronised first: no replay still queued reads them)."""
        self._fold_lanes()  # (the lanes' calls make their adapters recent)
        with self.lock:
            gone = {a.id for a in self.core.adapters.evict(before=self._sync_gpu)}
            if gone:
                self._forget_calls(lambda key: key[0] is ADAPTED and key[1] in gone)

    def _forget_merged(self) -> None:
        """After a merge switch (caller holds the lock, our GPU idle): every tenant's graphs and
        lanes forget the calls of merged copies and of the adapter now merged, which are computed
        another way from now on."""
        merged = self.core.adapters.merged_adapter
        now = merged.id if merged is not None else 0
        self._forget_calls(lambda key: key[0] is MERGED or (key[0] is ADAPTED and key[1] == now))

    def _forget_calls(self, stale) -> None:
        """Every tenant's graphs and lane entries whose hosted-adapter key (ADAPTED or MERGED)
        stale(key) picks are dropped (caller holds the lock, our GPU idle: no replay of theirs is queued)."""

        def picked(key) -> bool:
            return isinstance(key, tuple) and bool(key) and key[0] in (ADAPTED, MERGED) and stale(key)

        for t in self.tenants.values():
            for graphs in (t.areas.graphs, t.areas.own_graphs):
                if graphs is not None:
                    graphs.forget(picked)  # (on_drop unlearns the lane's header of each)
            for key in [k for k in t.areas.lane_keys if picked(k)]:
                self._unlearn(t.areas, key)
            self._drop_programs(t.areas, picked)

    def _sync_gpu(self) -> None:
        """Waits for all our GPU work (a merge switch or an eviction: no queued replay may read what goes)."""
        if self.core.device.type == "cuda":
            torch.cuda.synchronize(self.core.device)

    def _unlearn_adapter(self, owner: int, adapter: int) -> None:
        """The lanes that may name `adapter` (removed: its owner's, every tenant's for the
        provider's) forget the calls naming it: they go to Python again, which refuses them (caller
        holds the lock)."""
        def naming(k) -> bool:
            return isinstance(k, tuple) and bool(k) and ((k[0] is ADAPTED and k[1] == adapter) or (k[0] is MERGED and k[2] == adapter))

        for t in self.tenants.values() if owner == PROVIDER else filter(None, [self.tenants.get(owner)]):
            for key in [k for k in t.areas.lane_keys if naming(k)]:
                self._unlearn(t.areas, key)
            self._drop_programs(t.areas, naming)

    def _serve_lane(self, t: Tenant) -> int:
        """Serves the calls at the front of t's ring that its lane knows; how many."""
        areas = t.areas
        n = areas.lane.serve(mailbox.RING_SLOTS)
        if n:
            self.paths[NATIVE] += n
            self._count_late(areas)
            self._away_from_gangs(t)  # (a lane serves no ganged program's runs: calls of its own, or a lone program's)
            now = time.monotonic()
            t.last_call = now
            self.core.scheduler.lost_track(t.id)  # (where it is in its round of units: not seen)
            if areas.lane.was_idle or not areas.awaiting:
                t.waiting_since = now  # (as _run_waiting: the stall clock starts with a wait on an idle stream)
            areas.await_input(areas.lane.awaiting)
        return n

    def _fold_lane(self, areas) -> None:
        """Adds what areas' lane served to the counters (caller holds the lock)."""
        if areas.lane is None:
            return
        k = self.core.counters
        self._count_late(areas)
        for index, n in areas.lane.take_counts():
            entry = areas.lane_units[index]
            for unit in entry.calls if isinstance(entry, ProgramCounts) else (entry,):  # (a step program's: each call)
                self._count_lone(unit, n)
                k.native_calls += n

    def _count_lone(self, entry: tuple, n: int) -> None:
        """Counts n calls of one kind, each run alone as a graph replay: `entry` is (unit, op,
        tokens, latency, tenant, hosted adapter, merge epoch), as areas.lane_units holds it."""
        unit, op, tokens, latency, tenant, adapter, epoch = entry
        k = self.core.counters
        self.core.count(unit, op, n, n, n * tokens, latency)  # (each call its own batch)
        k.per_tenant_calls[tenant] += n
        k.per_tenant_tokens[tenant] += n * tokens
        if adapter:
            self.core.count_adapter(adapter, n, n * tokens, bool(epoch))
            self.core.adapters.touch(adapter, n)  # (a lane's adapter is on the device: hits, and recent)
        k.graph_replays += n

    def _count_late(self, areas) -> None:
        """Adds the calls areas' lane served late since the last look to self.paths (with the
        native lane's, so that stats never see more late calls than lane calls)."""
        late = areas.lane.late
        self.paths[LATE] += late - areas.lane_late
        areas.lane_late = late

    def _fold_lanes(self) -> None:
        with self.lock:
            for t in self.tenants.values():
                self._fold_lane(t.areas)

    def _check(self, t: Tenant, req: pb.CallRequest):
        """Validates a call's header against the served units and t's data area: (unit, input
        shape, output shape, input dtype) as ExecutorCore.check, and the header's key, or
        CallError. A tenant repeats a few headers over and over (one per unit and shape): those
        found valid are remembered for the data area (a grow makes a new one)."""
        key = (req.unit, req.op, req.dtype, tuple(req.shape), req.in_offset, req.out_offset)
        checked = t.areas.checked
        found = checked.get(key)
        if found is not None:
            return found
        unit, in_shape, out_shape, dtype = self.core.check(req.unit, req.op, req.dtype, req.shape)
        out_dtype = self.core.dtype
        in_bytes = codec.nbytes(in_shape, dtype)
        out_bytes = codec.nbytes(out_shape, out_dtype)
        cap = t.areas.data_bytes
        if in_bytes + out_bytes > self.config.max_mailbox_bytes:
            raise CallError(
                pb.RESOURCE_EXHAUSTED,
                f"call too large: input and output need {in_bytes + out_bytes} bytes, a mailbox may hold at most "
                f"{self.config.max_mailbox_bytes} (--max-mailbox-mb)",
            )
        for what, off, size, item in (("input", req.in_offset, in_bytes, dtype.itemsize), ("output", req.out_offset, out_bytes, out_dtype.itemsize)):
            if off % item:
                raise CallError(pb.INVALID_ARGUMENT, f"{what} offset {off} is not aligned to {item} bytes")
            if off + size > cap:
                raise CallError(
                    pb.INVALID_ARGUMENT,
                    f"{what} bytes [{off}, {off + size}) lie outside the mailbox's data area of {cap} bytes (grow it first)",
                )
        if req.in_offset < req.out_offset + out_bytes and req.out_offset < req.in_offset + in_bytes:
            raise CallError(pb.INVALID_ARGUMENT, f"input bytes at {req.in_offset} and output bytes at {req.out_offset} overlap")
        if len(checked) >= MAX_CHECKED:
            checked.clear()
        found = checked[key] = (unit, in_shape, out_shape, dtype, key)
        return found

    def _deliver(self, results: list[Result]) -> None:
        if any(r.call.tag.remote for r in results):  # (transports/remote.py: back through their tags)
            self._deliver_remote([r for r in results if r.call.tag.remote])
            results = [r for r in results if not r.call.tag.remote]
        told: dict[int, _Told] = {}  # by tenant id
        with self.lock:
            for r in results:
                d = r.call.tag
                t = d.tenant
                if self.tenants.get(t.id) is not t or t.area is not d.area:
                    continue  # detached or regrown mid-call: nobody to tell
                try:
                    self._place(t, r, d.out_offset)
                except Exception as e:  # one tenant's failed reply never stops the others'
                    log.exception("delivering to tenant %d failed", t.id)
                    self._reclaim(t, f"its reply could not be delivered: {type(e).__name__}")
                    continue
                out = told.setdefault(t.id, _Told(d.stream or self._stream))
                if d.input_seq and t.areas.out_word:
                    # a failed call's word is the tenant's to write (client/transports/unanswered.py)
                    if r.error is None and (not out.seq or reached(d.input_seq, out.seq)):
                        out.seq = d.input_seq
                else:
                    out.event = True
                out.results.append(r)
            now = time.monotonic()
            for tid, out in told.items():
                t = self.tenants.get(tid)
                if t is None:
                    continue
                t.last_reply = now
                # first (the tenant's GPU waits for it, not for the reply), and before any reply:
                # the tenant's GPU (or its host, told by the reply) waits for our writes
                if out.seq:
                    stream_write(out.stream.cuda_stream, t.areas.out_word, out.seq)
                if out.event and t.gpu is not None:
                    t.gpu.output_ready.record(out.stream)
                for r in out.results:
                    self._push(t, self._reply(r))
                t.box.reply_bell.ring()

    def _place(self, t: Tenant, r: Result, out_offset: int) -> None:
        """Writes r's result into t's mailbox, unless the GEMM wrote it there."""
        if r.error is None:
            y = r.y
            dest = t.area.view(out_offset, y.shape, y.dtype)
            if dest.data_ptr() != y.data_ptr():
                dest.copy_(y)

    @staticmethod
    def _reply(r: Result) -> pb.CallReply:
        if r.error is not None:
            return pb.CallReply(call_id=r.call.call_id, status=r.error.status())
        y = r.y
        return pb.CallReply(
            call_id=r.call.call_id, status=_OK, dtype=codec.dtype_enum(y.dtype), shape=list(y.shape),
            out_offset=r.call.tag.out_offset,
        )

    def _reply_error(self, t: Tenant, call_id: int, err: CallError) -> None:
        self._push(t, pb.CallReply(call_id=call_id, status=err.status()))
        if t.id in self.tenants:
            t.box.reply_bell.ring()

    def _push(self, t: Tenant, reply: pb.CallReply) -> None:
        if t.id not in self.tenants:
            return
        if not t.box.replies.push(reply.SerializeToString()):
            self._reclaim(t, f"reply ring full: the tenant has not read its last {mailbox.RING_SLOTS} replies")
        elif reply.status.code != pb.OK:  # (after the push: a tenant that sees the count finds the reply)
            t.box.count_failure()
