"""Gangs: the step programs of several same-GPU tenants run together, each call one GEMM over
all their rows (`serve --gang-slots N`; transports/programs.py decides when).

Alone, a tenant's step program runs on its own stream, one call at a time, each a GEMV reading
the unit's whole weight: sixteen decoding tenants read every weight sixteen times a token. Tenants
whose programs are the same calls (the same units, ops, shapes and dtypes, no hosted adapter)
share a gang: a round of the gang is one CUDA graph on one of its streams that, call by call,
waits for every taking-part tenant's program input word, gathers their input rows from their
mailboxes into one batch, runs the unit once over the batch, scatters the result rows back and
writes their program output words; after the last call, their output words (kernels/gang_words.py).
The graph holds no tenant: a slot's word and row addresses are in the gang's table, and whether
it takes part (and its run's input_seq) in `seqs`, written on the round's stream before it. A
gang has a graph on each of a few lanes (streams), so that rounds of tenants that did not come
together still run at once. A round waits for its slowest tenant: a tenant that stalls holds its
round, and the lane it is on, until it is detached (LocalServerConfig.input_timeout_s), as a
batch does.

Hosted adapters: programs naming hosted adapters (tenants' own or the provider's, any ranks) whose
deltas sit at the same places share gangs too (not with programs naming none, which pay no
adapter kernels). A slot's adapter at each delta is in the gang's adapter table, and the deltas
of one place in a call (a span's q, k and v) are two kernels over all the round's rows
(kernels/gang_lora.py), each slot its own adapter. The gang keeps a slot's adapter tensors until every round that read them is done, so a
paged-out or removed adapter's memory is not reused under a queued round.

The batch's GEMM is not bitwise the lone one (another kernel over more rows): a ganged tenant's
results are within the batching tolerance of its lone ones (README), its greedy tokens the same.
"""
from __future__ import annotations

import dataclasses

import torch

from symbiont.base_executor import runner
from symbiont.base_executor.adapters import MAX_RANK, Delta, GroupDelta, SpanDelta
from symbiont.base_executor.catalog import SPAN
from symbiont.base_executor.graphs import capture
from symbiont.base_executor.kernels import gang_words
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.codec import int32_words
from symbiont.proto.cuda_ipc import stream_write

# a slot's columns of words (PROGRAM_IN and PROGRAM_OUT in its device region with serve --device-words,
# the host's beside them; else the host's in both), then x and out rows per call
IN_WORD, PROGRAM_IN, PROGRAM_OUT, OUT_WORD, PROGRAM_IN_HOST, PROGRAM_OUT_HOST = range(6)
WORDS = 6
MAX_ROW_BYTES = 1 << 20  # a call's input or output row of one tenant that a gang copies, at most
ADAPTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # hosted adapters' dtypes gangs compute (gang_lora)


def gang_key(calls: list) -> tuple | None:
    """What programs must share to be one gang's (each call's unit, op, shapes and dtypes, and
    where its hosted adapter's deltas are: adapter_parts); None for a program that cannot be in a
    gang (a merged copy, an adapter on a backward call; rows not whole int32 words, or over
    MAX_ROW_BYTES)."""
    key = []
    for c in calls:
        if c.merge_epoch or c.out is None:
            return None
        if int32_words(c.x, MAX_ROW_BYTES) is None or int32_words(c.out, MAX_ROW_BYTES) is None:
            return None
        parts = adapter_parts(c)
        if parts is None:
            return None
        key.append((c.unit.id, c.op, c.latency, tuple(c.x.shape), c.x.dtype, tuple(c.out.shape), c.out.dtype,
                    tuple(p[:5] for p in parts)))
    return tuple(key)


def adapter_parts(call) -> list | None:
    """Where a call's hosted adapter adds its deltas: [(at, first column, width, input width,
    dtype, Delta)], `at` "y" (the unit's result), "o" or "qkv" (a span's o_proj and q/k/v
    results, runner._span); [] for a call naming none; None where a gang cannot add them (a
    backward call, an adapter of another kind or over MAX_RANK)."""
    d = call.adapter
    if d is None:
        return []
    if call.op not in (pb.FORWARD, pb.FORWARD_NO_BIAS) or call.x.dim() != 2:
        return None
    if isinstance(d, SpanDelta):
        found = [("o", 0, d.o.b.shape[0], d.o.a.shape[1], d.o)] if d.o is not None else []
        found += [("qkv", a, b - a, delta.a.shape[1], delta) for a, b, delta in (d.qkv.parts if d.qkv else ())]
    elif isinstance(d, GroupDelta):
        found = [("y", a, b - a, delta.a.shape[1], delta) for a, b, delta in d.parts]
    elif isinstance(d, Delta):
        found = [("y", 0, d.b.shape[0], d.a.shape[1], d)]
    else:
        return None
    if any(not (p[4].a.is_contiguous() and p[4].b.is_contiguous()) or p[4].a.shape[0] > MAX_RANK
           or p[4].a.dtype not in ADAPTER_DTYPES or p[4].b.dtype != p[4].a.dtype for p in found):
        return None
    if len({(p[0], p[4].a.dtype) for p in found}) != len({p[0] for p in found}):
        return None  # (one place's deltas are one launch: of one dtype)
    return [(at, first, width, k, delta.a.dtype, delta) for at, first, width, k, delta in found]


class _SlotDeltas:
    """A gang call's hosted adapters in a round: at each of its parts (adapter_parts), each
    taking-part slot's own delta on its rows (kernels/gang_lora.py, the slot's adapter from the
    gang's adapter table, whose columns for this call start at `col`). o(a, base) and qkv(n1, q)
    are a span's (runner.run's span_deltas); add("y", x, y) a unit's result."""

    def __init__(self, parts: list, col: int, adapters: torch.Tensor, seqs: torch.Tensor, rows: int, t: torch.Tensor):
        from symbiont.base_executor.kernels import gang_lora

        # per place, its parts' (first column, width), their table columns' start and dtype (a
        # place's parts are one adapter's, next to one another in adapter_parts' order)
        self.places = {}
        for i, (at, first, width, _, dtype) in enumerate(parts):
            places, start, _ = self.places.setdefault(at, ([], col + i * gang_lora.FIELDS, dtype))
            if start + len(places) * gang_lora.FIELDS != col + i * gang_lora.FIELDS:
                raise ValueError(f"a gang call's {at!r} deltas are not next to one another: {parts}")
            places.append((first, width))
        self.adapters, self.seqs, self.rows, self.t = adapters, seqs, rows, t

    def add(self, at: str, x: torch.Tensor, y: torch.Tensor) -> None:
        from symbiont.base_executor.kernels import gang_lora

        if at in self.places:  # (all its parts in one shrink and one expand)
            places, col, dtype = self.places[at]
            gang_lora.add(x, y, places, self.adapters, col, self.seqs, self.rows, self.t, dtype)

    def o(self, a: torch.Tensor, base: torch.Tensor) -> None:
        self.add("o", a, base)

    def qkv(self, n1: torch.Tensor, q: torch.Tensor) -> None:
        self.add("qkv", n1, q)


class LaneStream:
    """A warmed stream gangs' rounds run on, shared by every gang's lane on it: `done` is recorded
    after the last round queued on it, whichever gang's."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.done: torch.cuda.Event | None = None

    def idle(self) -> bool:
        return self.done is None or self.done.query()


class _Lane:
    """A gang's graph of a round on one LaneStream, with its own slot array and batches: rounds on
    different lanes run at once."""

    def __init__(self, on: LaneStream, slots: int, device: torch.device):
        self.on = on
        self.stream = on.stream
        with torch.cuda.stream(self.stream):  # (made where it is used: no other stream's queued work touches it)
            self.seqs = torch.zeros(slots, dtype=torch.int32, device=device)
        self.host_seqs = [0] * slots  # what `seqs` holds once the queued writes are done
        self.graph: torch.cuda.CUDAGraph | None = None
        self.batches: list = []  # the graph's batch tensors (kept while it lives)
        self.done: torch.cuda.Event | None = None  # recorded after this gang's last round on it
        self.failures = 0  # captures that failed

    def passed(self) -> bool:
        """Whether every round of this gang queued on the lane is done."""
        return self.done is None or self.done.query()


class Gang:
    """Up to `slots` tenants' programs of one key, and the graphs of their rounds, one per lane.
    `setup`: a stream no round runs on, where the table is written (each lane's stream waits for
    the writes: no round reads a slot's row before it is in)."""

    def __init__(self, key: tuple, calls: list, slots: int, streams: list, setup: torch.cuda.Stream, device: torch.device,
                 device_words: bool = False):
        self.key = key
        self.device_words = device_words  # its members' program words are in their device regions (host ones beside)
        # a member's calls, the units and shapes the graphs are captured for (without their adapters:
        # a slot's adapter tensors are kept only while its rounds may read them)
        self.calls = [dataclasses.replace(c, adapter=None) for c in calls]
        self.slots = slots
        self.setup = setup
        self.members: dict[int, object] = {}  # slot -> its Program (program.gang_slot is the slot)
        from symbiont.base_executor.kernels import gang_lora  # (Triton, imported where gangs run)

        self.parts = [list(call_key[-1]) for call_key in key]  # each call's hosted adapter deltas (gang_key's last field)
        n_parts = sum(map(len, self.parts))
        with torch.cuda.stream(setup):
            self.table = torch.zeros((slots, WORDS + 2 * len(calls)), dtype=torch.int64, device=device)
            # each slot's adapter at each part (kernels/gang_lora.py); rank 0 until a member's is written
            self.adapters = torch.zeros((slots, max(1, n_parts) * gang_lora.FIELDS), dtype=torch.int64, device=device)
        self._kept: dict[int, list] = {}  # slot -> its member's adapter deltas (their tensors the table points at)
        self._dropped: list = []  # (events of rounds that may read them, deltas) of members gone
        self.lanes = [_Lane(on, slots, device) for on in streams]
        self._after_setup()
        self._slot_rounds: list = [[] for _ in range(slots)]  # per slot, the events after rounds it took part in
        self.pending: dict[int, tuple] = {}  # tenant id -> (tenant, run request, program) of the next round
        self.since = 0.0  # when the oldest pending run came
        self.active: dict[int, float] = {}  # tenant id -> when its last round was queued
        self._flying: list = []  # (event, tenant ids) of rounds queued and maybe not done

    def _after_setup(self) -> None:
        """Every lane's stream waits (on the GPU) for what is queued on `setup` so far."""
        written = torch.cuda.Event()
        written.record(self.setup)
        for lane in self.lanes:
            lane.stream.wait_event(written)

    def tenants(self) -> set:
        """The tenants with a program in the gang (a tenant may have several: prompts of other lengths)."""
        return {p.tenant.id for p in self.members.values()}

    def _let_go(self) -> None:
        """Lets the adapter tensors of members gone go once the rounds that may read them are done."""
        if self._dropped:
            self._dropped = [(events, kept) for events, kept in self._dropped if not all(e.query() for e in events)]

    def free_slot(self) -> int | None:
        """A slot no member holds and no round queued still reads."""
        self._let_go()
        for s in range(self.slots):
            if s not in self.members:
                self._slot_rounds[s] = [e for e in self._slot_rounds[s] if not e.query()]
                if not self._slot_rounds[s]:
                    return s
        return None

    def join(self, slot: int, program, words: int, out_word: int, program_words: tuple) -> None:
        """Gives `slot` to a program of a tenant whose mailbox input word is at `words`, its program
        words at `program_words` (Areas.program_words)."""
        row = [words, program_words[0], program_words[1], out_word, program_words[2], program_words[3]]
        row += [c.x.data_ptr() for c in program.calls] + [c.out.data_ptr() for c in program.calls]
        from symbiont.base_executor.kernels import gang_lora

        values = torch.tensor(row, dtype=torch.int64).pin_memory()
        deltas = [p[5] for c in program.calls for p in adapter_parts(c)]
        adapters = torch.tensor([v for d in deltas for v in gang_lora.entry(d.a, d.b, d.scale)] or [0],
                                dtype=torch.int64).pin_memory()
        with torch.cuda.stream(self.setup):
            self.table[slot].copy_(values, non_blocking=True)
            self.adapters[slot, :adapters.numel()].copy_(adapters, non_blocking=True)
        self._after_setup()
        self._kept[slot] = deltas
        self.members[slot] = program
        program.gang, program.gang_slot = self, slot

    def leave(self, program) -> None:
        """The program's slot goes (reused once the rounds queued with it are done)."""
        if self.members.get(program.gang_slot) is program:
            del self.members[program.gang_slot]
            kept = self._kept.pop(program.gang_slot, [])
            if kept:  # (kept until the rounds queued with them are done: a queued round may still read them)
                self._dropped.append((list(self._slot_rounds[program.gang_slot]), kept))
            if program.tenant.id not in self.tenants():
                self.active.pop(program.tenant.id, None)
        program.gang = None

    def idle_lane(self) -> "_Lane | None":
        """A lane whose stream runs no round now (of any gang)."""
        return next((lane for lane in self.lanes if lane.on.idle()), None)

    def passed(self) -> bool:
        """Whether every round of the gang queued is done (its memory may go)."""
        return all(lane.passed() for lane in self.lanes)

    def flying(self) -> set:
        """The tenants in rounds queued and not done."""
        self._flying = [(e, ids) for e, ids in self._flying if not e.query()]
        return set().union(*(ids for _, ids in self._flying))

    def capture(self, lane: _Lane, exact: bool, fused_spans: bool = False) -> None:
        """Captures the gang's round on a lane's stream, after running it once there with every
        slot sitting out (no round has run on the lane yet: its `seqs` is 0), which loads what the
        capture may not. `fused_spans`: a span call's elementwise work in two kernels
        (runner.span_fused)."""
        n, slots = len(self.calls), self.slots
        device = self.table.device
        before = torch.cuda.current_stream(device)
        torch.cuda.set_stream(lane.stream)
        try:
            self._capture(lane, exact, n, slots, device, fused_spans)
        finally:
            torch.cuda.set_stream(before)

    def _capture(self, lane: _Lane, exact: bool, n: int, slots: int, device: torch.device, fused_spans: bool) -> None:
        batches = []
        for c in self.calls:  # (on the lane's stream, kept by the lane even if the capture fails)
            x = torch.zeros((slots * c.x.shape[0], *c.x.shape[1:]), dtype=c.x.dtype, device=device)
            y = torch.empty((slots * c.out.shape[0], *c.out.shape[1:]), dtype=c.out.dtype, device=device)
            batches.append((x, y))
        from symbiont.base_executor.kernels import gang_lora

        seqs, table = lane.seqs, self.table
        hosted = [None] * n
        rows = [c.x.shape[0] for c, parts in zip(self.calls, self.parts) if parts]
        if rows:  # (one float32 scratch for every delta's x A^T: the round's deltas run one after another)
            t = torch.empty((slots * max(rows), gang_lora.MAX_PARTS * MAX_RANK), dtype=torch.float32, device=device)
            batches.append((t, None))
            col = 0
            for k, (c, parts) in enumerate(zip(self.calls, self.parts)):
                if parts:
                    hosted[k] = _SlotDeltas(parts, col, self.adapters, seqs, c.x.shape[0], t)
                    col += len(parts) * gang_lora.FIELDS
        lane.batches = batches

        p_in_host, p_out_host = (PROGRAM_IN_HOST, PROGRAM_OUT_HOST) if self.device_words else (None, None)

        def round_() -> None:
            gang_words.wait(table, IN_WORD, seqs, from_seq=True)  # (the run's place among the tenant's calls)
            for k, (c, (x, y), deltas) in enumerate(zip(self.calls, batches, hosted), 1):
                gang_words.wait(table, PROGRAM_IN, seqs, k, also=p_in_host)
                if k == n:  # (the next run's first wait must not pass on this run's last number)
                    gang_words.write(table, PROGRAM_IN, seqs, 0, also=p_in_host)
                gang_words.gather(table, WORDS + k - 1, seqs, x)
                if c.unit.kind == SPAN and c.op == pb.FORWARD:  # (its deltas inside: runner's span_deltas)
                    if fused_spans:
                        runner.span_fused(c.unit, x, exact, y, deltas)
                    else:
                        runner.run(c.unit, c.op, x, exact, y, deltas)
                else:
                    runner.run(c.unit, c.op, x, exact, y)
                    if deltas is not None:
                        deltas.add("y", x, y)
                gang_words.scatter(y, table, WORDS + n + k - 1, seqs)
                gang_words.write(table, PROGRAM_OUT, seqs, k, also=p_out_host)
            gang_words.write(table, OUT_WORD, seqs, from_seq=True)

        round_()
        done = torch.cuda.Event()
        done.record(lane.stream)
        lane.done = done
        graph = torch.cuda.CUDAGraph()
        capture(graph, device, torch.cuda.graph_pool_handle(), round_)  # (a fresh pool each try)
        lane.graph = graph

    def run(self, lane: _Lane, seqs: dict[int, int], tenants: set, now: float) -> torch.cuda.Event:
        """Queues a round of the slots in `seqs` (slot -> its run's input_seq) on `lane`; the
        event recorded after it."""
        s = lane.stream.cuda_stream
        base = lane.seqs.data_ptr()
        for slot in range(self.slots):
            v = seqs.get(slot, 0)
            if v != lane.host_seqs[slot]:
                stream_write(s, base + 4 * slot, v)
                lane.host_seqs[slot] = v
        before = torch.cuda.current_stream(self.table.device)
        torch.cuda.set_stream(lane.stream)
        try:
            lane.graph.replay()
            done = torch.cuda.Event()
            done.record(lane.stream)
        finally:
            torch.cuda.set_stream(before)
        lane.done = lane.on.done = done
        self._let_go()
        for slot in seqs:
            self._slot_rounds[slot] = [e for e in self._slot_rounds[slot] if not e.query()] + [done]
        self._flying = [(e, ids) for e, ids in self._flying if not e.query()] + [(done, tenants)]
        for tid in tenants:
            self.active[tid] = now
        return done
