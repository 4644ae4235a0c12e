"""Step programs of same-GPU tenants (`local://NAME`), executor side: the calls of one decoding
step, defined once, each run as a CUDA graph on the tenant's own stream.

A tenant that replays its decoding step as a CUDA graph (client/step_graphs.py) cannot make its
calls from its host: its graph writes the mailbox's program input word with each call's number
(1, 2, ...) once the call's input is in, and waits for the program output word to reach it before
reading the result. It defines the step's calls once (ControlRequest.program: their headers, in
order); the data loop captures each call as a graph on the tenant's stream (the CallGraphs of that
stream). A run is one CallRequest naming the program, ordered with the tenant's other calls by the
mailbox's two words like any call: our stream waits for its input_seq, then for each call waits for
its number in the program input word, replays its graph and writes the number to the program
output word (the input word is set back to 0 after the last wait, the output word by the tenant
after its last, so the next run counts from 1 again), then writes the output word. After its first
run the tenant's native lane serves the runs (ServeLane.learn_program: no Python per step). A
tenant detached or dead mid-run has its program words released with its input word
(Areas.release_wait). Tenants whose programs are the same calls share a gang (transports/gangs.py):
while a gang holds two or more, their runs wait in it for its next round instead (_launch_gangs).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch
from google.protobuf.message import DecodeError

from symbiont.base_executor.core import CallError
from symbiont.base_executor.transports.areas import Tenant
from symbiont.base_executor.transports.call_paths import GANG, PROGRAM
from symbiont.base_executor.transports.gangs import Gang, LaneStream, gang_key
from symbiont.proto.cuda_ipc import reached, stream_wait, stream_write
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")
_OK = pb.Status(code=pb.OK)
MAX_PROGRAM_CALLS = 1024  # calls one step program may hold
ACTIVE_S = 0.05  # a gang member whose last round is older than this is not waited for
CAPTURE_TRIES = 3  # failed captures of a gang's round on one lane before the gang is given up
LANE_POLL_S = 20e-6  # how soon a gang whose lanes are all busy is looked at again
MAX_PROGRAMS = 64  # programs kept per data area; the oldest goes first beyond it (a tenant keeps 8 steps a thread)
DEFINE_TIMEOUT_S = 60.0


@dataclasses.dataclass(eq=False)
class Program:
    graphs: list  # each call's torch.cuda.CUDAGraph, in order
    calls: list  # the scheduler Calls they compute
    counts: "ProgramCounts"
    header: bytes = b""  # the run request's header once the lane knows it
    tenant: Tenant | None = None
    gang: Gang | None = None  # the gang it has a slot in (transports/gangs.py)
    gang_slot: int = -1
    hosted: dict = dataclasses.field(default_factory=dict)  # hosted adapter id -> (its calls naming it, their tokens)
    device_words: bool = False  # its words are the device region's (ProgramRequest.device_words; Areas.program_words)


@dataclasses.dataclass(eq=False, frozen=True)
class ProgramCounts:
    """What a run of a program counts (the lane's entry for it: no graphs or tensors kept)."""

    calls: tuple  # each call's (unit, op, tokens, latency, tenant, hosted adapter, merge epoch), as LocalCalls._count_lone takes it


@dataclasses.dataclass(eq=False)
class ProgramJob:
    """A definition handed from the control thread to the data loop, which captures it."""

    requests: list
    device_words: bool = False  # ProgramRequest.device_words
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    reply: pb.ControlReply | None = None


class LocalPrograms:
    """Step programs of LocalServer; `self` is the LocalServer."""

    def _define_program(self, t: Tenant, request: pb.ProgramRequest) -> pb.ControlReply:
        """Control thread: checks a definition, hands it to the data loop and waits for its
        capture (the tenant's own stream is the data loop's to use)."""
        from symbiont.base_executor.transports.local_control import control_error

        areas = t.areas
        if not (self.config.gpu_waits and self.config.graph_tokens and areas.stream is not None and areas.words
                and areas.out_word):
            return control_error(pb.INVALID_ARGUMENT, "step programs need a same-GPU tenant whose mailbox words our GPU "
                                 "waits on, GPU waits and graphs on (serve without --no-gpu-waits, --graph-tokens 0)")
        if request.device_words and not areas.device_words:  # (its graph would wait on words nobody writes)
            return control_error(pb.INVALID_ARGUMENT, "the program asks for device words, which this mailbox has not "
                                 "(serve --device-words, CudaRegion.words_offset)")
        if not 0 < len(request.calls) <= MAX_PROGRAM_CALLS:
            return control_error(pb.INVALID_ARGUMENT, f"a step program holds 1 to {MAX_PROGRAM_CALLS} calls, got {len(request.calls)}")
        requests = []
        for i, raw in enumerate(request.calls):
            try:
                req = pb.CallRequest.FromString(raw)
            except DecodeError as e:
                return control_error(pb.MALFORMED, f"call {i} of the program does not parse as CallRequest: {e}")
            if req.program or req.call_id or req.input_seq or req.payload:
                return control_error(pb.INVALID_ARGUMENT, f"call {i} of the program sets program, call_id, input_seq or payload")
            requests.append(req)
        job = ProgramJob(requests, request.device_words)
        with self.lock:
            if self.tenants.get(t.id) is not t:
                return control_error(pb.NOT_ATTACHED, f"tenant {t.id} was detached")
            areas.program_jobs.append(job)
        self.wake.ring()
        deadline = time.monotonic() + DEFINE_TIMEOUT_S
        while not job.done.wait(0.1):  # (detached meanwhile: _reclaim answers it; stopping: nobody will)
            if self.stopping.is_set() or time.monotonic() > deadline:
                return control_error(pb.UNAVAILABLE, "the executor is stopping" if self.stopping.is_set() else
                                     f"the data loop did not take the program within {DEFINE_TIMEOUT_S:.0f} s")
        return job.reply

    def _capture_programs(self, t: Tenant) -> None:
        """Data loop, under the lock: captures t's programs handed over (_define_program)."""
        from symbiont.base_executor.transports.local_control import control_error

        jobs, t.areas.program_jobs = t.areas.program_jobs, []
        for job in jobs:
            if not t.areas.warm and self._gpu_waits():  # (warming it synchronises our GPU: not behind a stalled tenant)
                t.areas.wants_warm = True
                job.reply = pb.ControlReply(status=pb.Status(code=pb.RETRY_LATER, retry_after_us=100_000, message=(
                    "the tenant's stream at the executor has run no call yet; it is warmed up soon: define the program again")))
                job.done.set()
                continue
            try:
                job.reply = self._capture_program(t, job.requests, job.device_words)
            except CallError as e:
                job.reply = control_error(e.code, e.message)
            except Exception as e:  # (its tenant's steps run eagerly: the client falls back)
                log.exception("capturing a step program of tenant %d failed", t.id)
                job.reply = control_error(pb.INTERNAL, f"capturing the program failed: {type(e).__name__}: {e}")
            job.done.set()

    def _capture_program(self, t: Tenant, requests: list, device_words: bool = False) -> pb.ControlReply:
        areas = t.areas
        if not areas.warm:  # (its calls so far went the scheduler's way; no stream of ours waits: _capture_programs)
            self.warm_stream(areas)
        if areas.waiting():
            raise CallError(pb.INVALID_ARGUMENT, "the tenant's calls are still running: define a program once they are done")
        calls = [self._to_call(t, req) for req in requests]
        for i, c in enumerate(calls):
            if c.out is None or c.merge_epoch:
                raise CallError(pb.INVALID_ARGUMENT, f"call {i} of the program ({c.unit.id}) cannot be in a program "
                                "(a merged adapter's copy: not yet)")
        graphs = self._graphs(areas, own=True)
        exact = self.core.scheduler.config.exact
        torch.cuda.set_stream(areas.stream)  # (a graph is captured on the stream it is replayed on)
        try:
            captured = [graphs.graph_for(c, exact) for c in calls]
        except ValueError as e:
            raise CallError(pb.INVALID_ARGUMENT, f"a call of the program cannot be in one: {e}") from None
        finally:
            torch.cuda.set_stream(self._stream)
        if len(areas.programs) >= MAX_PROGRAMS:
            self._drop_program(areas, next(iter(areas.programs)))
        pid = areas.next_program
        areas.next_program += 1
        counts = ProgramCounts(tuple((c.unit, c.op, c.tokens, c.latency, t.id, c.adapter_id, 0) for c in calls))
        areas.programs[pid] = prog = Program(captured, calls, counts, tenant=t,
                                             device_words=device_words and bool(areas.device_words))
        for c in calls:
            if c.adapter_id:
                n, tokens = prog.hosted.get(c.adapter_id, (0, 0))
                prog.hosted[c.adapter_id] = (n + 1, tokens + c.tokens)
        try:
            self._join_gang(prog)
        except Exception:  # (its runs go alone)
            log.exception("tenant %d: step program %d could not join a gang", t.id, pid)
        log.info("tenant %d: step program %d of %d calls captured%s", t.id, pid, len(calls),
                 f" (gang of {len(prog.gang.members)})" if prog.gang is not None else "")
        return pb.ControlReply(status=_OK, program=pb.ProgramReply(id=pid))

    def _drop_programs(self, areas, stale) -> None:
        """Drops areas' programs holding a call whose graph key stale(key) picks (a hosted adapter
        evicted, switched or removed): the tenant's next run of one is refused, and its step
        raises InvalidCallError at its end."""
        for pid in [pid for pid, prog in areas.programs.items() if any(stale(c.graph_key) for c in prog.calls)]:
            self._drop_program(areas, pid)

    def _drop_program(self, areas, pid: int) -> None:
        """Forgets a program (caller holds the lock): no run of it is taken from now on (one
        asked for is refused), and its graphs and calls are kept until the runs queued before
        have passed (drop_passed), without a wait here."""
        prog = areas.programs.pop(pid)
        if prog.header and areas.lane is not None:
            areas.lane.forget(prog.header)
        if prog.gang is not None:
            self._leave_gang(areas, prog, f"step program {pid} was dropped (beyond the programs kept): define it again")
        if areas.stream is not None:
            done = torch.cuda.Event()
            done.record(areas.stream)
            areas.dropped.append((prog, done))

    def warm_stream(self, areas) -> None:
        """Runs a GEMM on areas' stream once (it synchronises our GPU: a round with no GPU wait of ours)."""
        self.core.warm_up(areas.stream)
        areas.warm, areas.wants_warm = True, False

    def _tend_programs(self, t: Tenant) -> None:
        """Data loop, under the lock: warms t's stream when a definition asked for it and no stream
        of ours waits; lets dropped programs go once their runs have passed."""
        areas = t.areas
        if areas.wants_warm and areas.stream is not None and not self._gpu_waits():
            self.warm_stream(areas)
        if areas.dropped:
            areas.dropped = [(p, done) for p, done in areas.dropped if not done.query()]

    def _run_program(self, t: Tenant, req: pb.CallRequest, stopping: bool, alone: bool = False) -> None:
        """Runs a step program's run request from Python (its first, or one the lane did not
        take): behind the GPU wait for its input_seq on t's own stream, the program's graph, the
        output word; then teaches the lane its header."""
        areas = t.areas
        prog = areas.programs.get(req.program)
        if stopping or prog is None or not req.input_seq:
            self.core.counters.errors += 1
            why = (CallError(pb.UNAVAILABLE, "executor is shutting down") if stopping else
                   CallError(pb.INVALID_ARGUMENT, f"no step program {req.program} on this mailbox (never defined, dropped "
                             "with a hosted adapter it names, or beyond the programs kept): define it again") if prog is None else
                   CallError(pb.INVALID_ARGUMENT, "a program's run needs an input_seq"))
            self._reply_error(t, req.call_id, why)
            return
        gang = prog.gang
        ganged = gang is not None and len(gang.tenants()) > 1
        if ganged and not alone:  # (its next round runs it: _launch_gangs)
            if not gang.pending:
                gang.since = time.monotonic()
            gang.pending[t.id] = (t, req, prog)
            areas.gang_run = True
            return
        stream = areas.stream
        s = stream.cuda_stream
        # (the driver's waits are on the host's input word, which the tenant's graph writes too; the
        # output word is written where its graph waits, and to the host's, which the host reads)
        _, p_out, p_in, p_out_host = areas.program_words(prog.device_words)
        self._gpu_wait(t, stream, req.input_seq)
        torch.cuda.set_stream(stream)
        try:
            for k, graph in enumerate(prog.graphs, 1):  # (as ServeLane.learn_program's runs)
                stream_wait(s, p_in, k)
                if k == len(prog.graphs):
                    stream_write(s, p_in, 0)  # (the next run's first wait must not pass on this run's last number)
                graph.replay()
                if p_out_host != p_out:  # (the host's first: docs/gpu.md, "Device words")
                    stream_write(s, p_out_host, k)
                stream_write(s, p_out, k)
        finally:
            torch.cuda.set_stream(self._stream)
        stream_write(s, areas.out_word, req.input_seq)
        reply = pb.CallReply(call_id=req.call_id, status=_OK)
        self._push(t, reply)
        t.box.reply_bell.ring()
        self.paths[PROGRAM] += 1
        for call in prog.counts.calls:
            self._count_lone(call, 1)
        if self.config.native_serve and not self._native_failed and not prog.header and not ganged:
            lane = self._lane(t, areas.own_graphs)
            if lane is not None:
                request = pb.CallRequest()
                request.CopyFrom(req)
                request.ClearField("call_id")
                request.ClearField("input_seq")
                header = request.SerializeToString()
                reply.ClearField("call_id")
                try:
                    also = {"program_out_also": p_out_host} if p_out_host != p_out else {}  # (an older build takes none)
                    lane.learn_program(header, [int(g.raw_cuda_graph_exec()) for g in prog.graphs],
                                       p_in, p_out, reply.SerializeToString(), len(areas.lane_units), **also)
                except Exception as e:  # (its runs are served from Python, as every call's are then)
                    self._native_failed = True
                    log.warning("native serving off: teaching a lane a step program failed (%s: %s)", type(e).__name__, e)
                else:
                    prog.header = header
                    areas.lane_units.append(prog.counts)

    # ---- gangs: several tenants' runs of the same calls together (transports/gangs.py) --------

    def _start_gangs(self) -> None:
        """Data loop, at its start on a GPU: the gangs' lane streams, warmed (cuBLAS's workspace,
        the gang kernels compiled) while no stream of ours waits on a tenant, and the stream their
        tables are written on; gangs off where that fails."""
        if not (self.config.gang_slots and self.config.gpu_waits and self.config.graph_tokens):
            return
        try:
            from symbiont.base_executor.kernels import gang_words

            # (before warm: the kernel is compiled for them)
            gang_words.SPIN_WARPS, gang_words.SPIN_NAP_NS = self.config.spin_warps, self.config.spin_nap_ns
            streams = [torch.cuda.Stream(self.core.device, priority=self.config.gang_priority)
                       for _ in range(self.config.gang_lanes)]
            for stream in streams:
                self.core.warm_up(stream)
                with torch.cuda.stream(stream):
                    gang_words.warm(self.core.device, self.config.gang_slots, bool(self.areas.device_words))
                stream.synchronize()
        except Exception as e:  # (no Triton: every program runs alone)
            log.warning("gangs of step programs off: %s: %s", type(e).__name__, e)
            return
        self._gang_setup = torch.cuda.Stream(self.core.device)
        self._gang_streams = [LaneStream(s) for s in streams]

    def _join_gang(self, prog: Program) -> None:
        """Gives a program just captured a slot in the gang of its calls, a new gang where none has
        one free. Once a gang holds two tenants, its programs' runs go to it: their lanes forget them."""
        key = gang_key(prog.calls) if self._gang_streams else None
        if key is None or key in self._gang_failed:
            return
        gang = slot = None
        for g in self._gangs:
            if g.key == key and (slot := g.free_slot()) is not None:
                gang = g
                break
        if gang is None:
            gang = Gang(key, prog.calls, self.config.gang_slots, self._gang_streams, self._gang_setup, self.core.device,
                        device_words=self.areas.device_words)
            self._gangs.append(gang)
            slot = 0
        areas = prog.tenant.areas
        gang.join(slot, prog, areas.words, areas.out_word, areas.program_words(prog.device_words))
        if len(gang.tenants()) > 1:
            for member in gang.members.values():
                if member.header and member.tenant.areas.lane is not None:
                    member.tenant.areas.lane.forget(member.header)
                    member.header = b""

    def _leave_gangs(self, areas, why: str | None) -> None:
        """areas go out of use (caller holds the lock): their programs leave their gangs; a run
        waiting in one is refused (`why`; None: its tenant is detached, no reply)."""
        for prog in areas.programs.values():
            if prog.gang is not None:
                self._leave_gang(areas, prog, why)

    def _leave_gang(self, areas, prog: Program, why: str | None) -> None:
        gang = prog.gang
        pending = gang.pending.get(prog.tenant.id)
        if pending is not None and pending[2] is prog:  # (refused: the tenant's step fails and is captured again)
            del gang.pending[prog.tenant.id]
            areas.gang_run = False
            if why is not None:
                self.core.counters.errors += 1
                self._reply_error(prog.tenant, pending[1].call_id, CallError(pb.INVALID_ARGUMENT, why))
        gang.leave(prog)
        if not gang.members:
            self._retire_gang(gang)

    def _away_from_gangs(self, t: Tenant) -> None:
        """t made a call of its own, not a program's run (a prefill, an eager step): the rounds of
        its gangs no longer wait for it (gang_wait_us each, for ACTIVE_S) until its next run."""
        areas = t.areas
        if areas is not None:
            for prog in areas.programs.values():
                if prog.gang is not None:
                    prog.gang.active.pop(t.id, None)

    def _retire_gang(self, gang: Gang) -> None:
        """The gang takes no more runs; its graphs and buffers go once its rounds queued are done."""
        if gang in self._gangs:
            self._gangs.remove(gang)
            self._gangs_retired.append(gang)
        for prog in list(gang.members.values()):
            gang.leave(prog)

    def _launch_gangs(self, now: float, stopping: bool) -> bool:
        """Data loop, under the lock: queues a round of each gang with runs waiting on a lane of it
        whose stream is idle, once every member it waits for has asked (those whose last round was
        recent and is done: a convoy) or its wait is over (gang_wait_us since the first asked);
        while no lane is idle, more runs gather. Whether any was queued."""
        if self._gangs_retired:
            self._gangs_retired = [g for g in self._gangs_retired if not g.passed()]
        ran = False
        for gang in list(self._gangs):
            if not gang.pending:
                continue
            lane = gang.idle_lane()
            if lane is None and not stopping:
                continue
            expected = {tid for tid, at in gang.active.items() if now - at < ACTIVE_S} - gang.flying()
            if stopping or expected <= gang.pending.keys() or now - gang.since >= self.config.gang_wait_us * 1e-6:
                try:
                    self._launch_gang(gang, lane or gang.lanes[0])
                except Exception:  # (whatever one gang does, the data loop serves the others)
                    log.exception("a gang's round failed; its programs run alone from now on")
                    self._gang_failed.add(gang.key)
                    self._retire_gang(gang)
                ran = True
        return ran

    def _gangs_due(self, now: float) -> float | None:
        """When a gang with runs waiting is to be looked at again (None: no run waits)."""
        due = [g.since + self.config.gang_wait_us * 1e-6 if g.idle_lane() is not None else now + LANE_POLL_S
               for g in self._gangs if g.pending]
        return min(due) if due else None

    def _launch_gang(self, gang: Gang, lane) -> None:
        if lane.graph is None:
            try:
                exact = self.core.scheduler.config.exact
                gang.capture(lane, exact, fused_spans=self.config.gang_spans == "fused" and not exact)
            except Exception:
                lane.failures += 1
                log.exception("a gang's round could not be captured (%d of %d tries)", lane.failures, CAPTURE_TRIES)
                self._gang_runs_alone(gang, lane)
                return
        runs, gang.pending = list(gang.pending.values()), {}
        now = time.monotonic()
        try:
            done = gang.run(lane, {prog.gang_slot: req.input_seq for _, req, prog in runs}, {t.id for t, _, _ in runs}, now)
        except Exception:  # (the runs go alone; the gang with them: a round that cannot be queued)
            log.exception("a gang's round could not be queued")
            gang.pending = {run[0].id: run for run in runs}
            lane.failures = CAPTURE_TRIES
            self._gang_runs_alone(gang, lane)
            return
        k = self.core.counters
        members = [(t, req.input_seq) for t, req, _ in runs]
        for t, req, prog in runs:
            areas = t.areas
            areas.gang_run = False
            if not areas.waiting():
                t.waiting_since = now
            areas.await_input(req.input_seq, done)  # (the stall clock and releases as for a batch's wait)
            areas.gang_round = (done, members)
            try:
                self._push(t, pb.CallReply(call_id=req.call_id, status=_OK))
                t.box.reply_bell.ring()
            except Exception as e:  # (whatever one tenant's mailbox does, the others' replies go)
                log.exception("replying to tenant %d's run in a gang failed", t.id)
                self._reclaim(t, f"internal error on its reply: {type(e).__name__}: {e}", release=True)
            k.per_tenant_calls[t.id] += len(prog.calls)
            k.per_tenant_tokens[t.id] += sum(c.tokens for c in prog.calls)
            for aid, (calls, tokens) in prog.hosted.items():  # (on the device: hits, recent; the orchestrator's traffic)
                self.core.count_adapter(aid, calls, tokens, False)
                self.core.adapters.touch(aid, calls)
        self.paths[GANG] += len(runs)
        n = len(runs)
        for c in gang.calls:
            self.core.count(c.unit, c.op, n, 1, n * c.tokens, c.latency)
        k.graph_replays += 1

    def _gang_runs_alone(self, gang: Gang, lane) -> None:
        """After a failure of a gang's lane: the runs waiting in the gang run alone; after
        CAPTURE_TRIES failures the gang goes (its programs run alone from then on)."""
        runs, gang.pending = list(gang.pending.values()), {}
        if lane.failures >= CAPTURE_TRIES:
            self._gang_failed.add(gang.key)
            self._retire_gang(gang)
        for t, req, _ in runs:
            t.areas.gang_run = False
            try:
                self._run_program(t, req, False, alone=True)
            except Exception as e:
                log.exception("tenant %d's run failed alone too", t.id)
                self._reclaim(t, f"internal error on its run: {type(e).__name__}: {e}", release=True)

    def _holds_its_round(self, t: Tenant) -> bool:
        """Whether t, waited for past the stall timeout, is what holds the gang round it is in (so
        it is detached, not the others): its input word short of its run's, or its program input
        word behind another member's (each member that came waits at the call the round is at).
        True too where no member is behind (nothing tells them apart), or t is in no round."""
        gr = t.areas.gang_round
        if gr is None or gr[0].query():
            return True
        at = {}
        for m, seq in gr[1]:
            if self.tenants.get(m.id) is not m:  # (detached: its words released, its mailbox maybe gone)
                continue
            box = m.box
            at[m.id] = box.program_input_word() if reached(box.input_word(), seq) else -1
        if len(set(at.values())) <= 1:
            return True
        return at.get(t.id, -1) < max(at.values())
