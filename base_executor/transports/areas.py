"""Tenants of the same-host transport and their data areas, from creation to release.

A tenant's areas are its host mailbox (a sealed memfd: rings, reply doorbell and, for a tenant
off the executor's GPU, the tensor bytes) and, for a tenant on the executor's GPU, a device
region shared by CUDA IPC handle. On a GPU executor the host data area is page-locked, so the
copies between it and the GPU are DMA with no staging copy.

Areas are made at attach and grow, retired at detach, grow or a tenant's death, and released
by the data loop between batches. A retired device region is not freed while its owner process
lives: the tenant may still map it, and CUDA leaves freeing memory that another process maps
undefined (the next tenant could be handed memory the last one still reads). It is parked for
that process instead, reused when the same process attaches or grows again, and freed once the
process is gone.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch

from symbiont.proto import executor_pb2 as pb
from symbiont.proto import mailbox
from symbiont.proto.procs import start_time

log = logging.getLogger("base_executor")

Owner = tuple[int, int]  # (pid, start time): one process, even once its pid is reused


def owner_of(pid: int) -> Owner:
    return (pid, start_time(pid))


def owner_alive(owner: Owner) -> bool:
    return owner[1] != 0 and start_time(owner[0]) == owner[1]


@dataclasses.dataclass(eq=False)
class Areas:
    fd: int
    box: mailbox.Mailbox  # rings, reply doorbell, and the data area of a host tenant
    pinned: int = 0  # address of the page-locked host data area, 0 when not page-locked
    gpu: "object | None" = None  # proto.cuda_ipc.DeviceRegion: the data area of a tenant on our GPU
    words: int = 0  # device address of the mailbox's input word, 0 when our GPU cannot wait on it
    out_word: int = 0  # device address of the mailbox's output word (set with `words`)
    device_words: int = 0  # device address of the device region's words (proto/mailbox.py DEVICE_WORDS), 0: none
    stream: "torch.cuda.ExternalStream | None" = None  # runs this tenant's calls whose input is not in yet
    awaiting: int = 0  # the input_seq queued on `stream` (or before `waited`) to wait for (0: none)
    waited: "torch.cuda.Event | None" = None  # recorded after a batch on another stream that waits for `awaiting`; None: `stream` waits
    warm: bool = False  # the data loop's GEMMs have run on `stream` once
    checked: dict = dataclasses.field(default_factory=dict)  # call headers found valid for this data area (LocalServer._check)
    graphs: "object | None" = None  # base_executor.graphs.CallGraphs of its calls on the data loop's stream
    own_graphs: "object | None" = None  # ... and on `stream`
    lane: "object | None" = None  # proto._stream_ops.ServeLane: serves repeats of own_graphs' calls natively
    lane_keys: dict = dataclasses.field(default_factory=dict)  # graph key -> request header the lane knows
    lane_small: bool = False  # the lane knows a call of fewer than solo_tokens tokens (LocalServer._learn)
    programs: dict = dataclasses.field(default_factory=dict)  # id -> its step programs (transports/programs.py)
    dropped: list = dataclasses.field(default_factory=list)  # (program, event): kept until a run queued before has passed
    released: bool = False  # release_wait let its waits go, and step programs' runs may still set a word back
    gang_run: bool = False  # a step program's run waits in its gang for the next round (its later calls wait behind it)
    gang_round: tuple | None = None  # (event after it, [(tenant, input_seq)]) of the last gang round it took part in
    wants_warm: bool = False  # a step program's definition found `stream` cold (warmed at a round with no GPU wait)
    program_jobs: list = dataclasses.field(default_factory=list)  # definitions for the data loop to capture
    next_program: int = 1
    lane_units: list = dataclasses.field(default_factory=list)  # by the lane's entry index: (unit, op, tokens, latency, tenant, adapter, epoch), or a step program's ProgramCounts
    lane_late: int = 0  # the lane's `late` count folded into LocalServer.paths

    @property
    def data(self):
        """Where the tensors live: the device region, else the host mailbox."""
        return self.gpu or self.box

    @property
    def data_bytes(self) -> int:
        """The tensor bytes (a device region's words after them are not among them)."""
        if self.gpu is None:
            return self.box.data_bytes
        return self.gpu.nbytes - (mailbox.DEVICE_WORDS_BYTES if self.device_words else 0)

    def program_words(self, device: bool) -> tuple[int, int, int, int]:
        """Our GPU's addresses of a step program's words: (input word its graphs' waits look at,
        output word they write, input word, output word in the host's page). Without device words
        (or for a program whose definition did not ask for them: `device`) the first two are the host's."""
        p_in, p_out = mailbox.program_words(self.words)
        if not (device and self.device_words):
            return p_in, p_out, p_in, p_out
        return (self.device_words + mailbox.DEVICE_PROGRAM_IN, self.device_words + mailbox.DEVICE_PROGRAM_OUT,
                p_in, p_out)

    @property
    def total_bytes(self) -> int:
        """The host mailbox and the device region together."""
        return mailbox.Mailbox.total_bytes(self.box.data_bytes) + (self.gpu.nbytes if self.gpu is not None else 0)

    def waiting(self) -> bool:
        """Whether a stream of ours may still wait for the tenant's input: `stream`, or a batch's
        stream up to `waited`. Their progress says so, not the word, which the tenant could set back."""
        if self.released and self.awaiting:  # (each step program's run queued sets its word back: release again)
            self.box.release_program(output=False)
            self.box.set_input_word(self.awaiting)
        if self.awaiting and (self.waited.query() if self.waited is not None else self.stream.query()):
            self.awaiting, self.waited = 0, None
        return bool(self.awaiting)

    def await_input(self, seq: int, waited: "torch.cuda.Event | None" = None) -> None:
        """A stream of ours now waits for input `seq` (after any earlier one: the tenant's inputs
        come in order): `stream`, or a batch's stream until `waited` (recorded later, before the
        next look at waiting())."""
        self.awaiting, self.waited = seq, waited

    def release_wait(self) -> None:
        """Lets `stream` go on whatever the tenant does: its call then reads a stale input that
        nobody will read the result of (the tenant is detached)."""
        if self.awaiting:
            self.box.set_input_word(self.awaiting)
            if self.programs:  # (a run's waits for its calls' inputs too, again at each look until the stream has passed them)
                self.box.release_program(output=False)
                self.released = True
                return
            self.awaiting, self.waited = 0, None


@dataclasses.dataclass(eq=False)
class Tenant:
    id: int
    name: str
    pid: int
    owner: Owner
    token: str
    areas: Areas
    held: tuple[pb.CallRequest, float] | None = None  # a same-GPU call whose input copy is still running
    waiting_since: float = 0.0  # when the call `areas.stream` waits for was taken
    last_call: float = 0.0  # when its last call was taken from its ring
    last_reply: float = 0.0  # when its last result was delivered (it may call again soon)

    @property
    def box(self) -> mailbox.Mailbox:
        return self.areas.box

    @property
    def gpu(self):
        return self.areas.gpu

    @property
    def area(self):
        """Where this tenant's tensors live: its device region, else its host mailbox."""
        return self.areas.data


class AreaPool:
    def __init__(self, name: str, device: torch.device, device_words: bool = False):
        self.name = name
        self.device = device
        self.device_words = device_words  # same-GPU tenants' program words in their device regions too
        self._lock = threading.Lock()  # attach and grow come on the control thread
        self._retired: list[tuple[Areas, Owner]] = []  # released by the data loop
        self._parked: dict[Owner, list] = {}  # device regions their owner may still map

    def new(self, tid: int, owner: Owner, data_bytes: int, on_gpu: bool) -> Areas:
        """A mailbox with `data_bytes` of data area, on the executor's GPU when on_gpu."""
        host_bytes = 0 if on_gpu else data_bytes
        fd, mem = mailbox.create_region(f"symbiont-{self.name}-t{tid}", mailbox.Mailbox.total_bytes(host_bytes))
        areas = Areas(fd, mailbox.Mailbox(mem, host_bytes))
        try:
            if on_gpu:
                extra = mailbox.DEVICE_WORDS_BYTES if self.device_words else 0
                areas.gpu = self._region(owner, mailbox.align(data_bytes) + extra if extra else data_bytes)
                self._map_words(areas)
                if extra and areas.words:  # (zero: a parked region's words hold its last mailbox's numbers)
                    from symbiont.proto.cuda_ipc import zero_device

                    words = areas.gpu.ptr + areas.gpu.nbytes - extra  # (aligned: nbytes is, a parked one's too)
                    try:
                        zero_device(self.device, words, extra)
                        areas.device_words = words
                    except RuntimeError as e:  # (its programs use the host's words)
                        log.warning("device words not zeroed (%s): tenant %d's programs use the host's words", e, tid)
            elif self.device.type == "cuda" and host_bytes:
                from symbiont.proto.cuda_ipc import pin_host

                base = torch.frombuffer(mem, dtype=torch.uint8).data_ptr()  # no buffer export is kept
                pin_host(self.device, base, len(mem))
                areas.pinned = base
        except BaseException:
            areas.box.close()
            os.close(fd)
            raise
        return areas

    def _map_words(self, areas: Areas) -> None:
        """Lets our GPU wait on the tenant's input word, on a stream of the tenant's own; where the
        driver cannot, the tenant's calls wait on the host for its input_ready event instead."""
        from symbiont.proto.cuda_ipc import drop_stream, own_stream, stream_wait, stream_write

        words = stream = None
        try:
            words, out_word = areas.box.map_words(self.device)
            stream = own_stream(self.device)
            # the driver may map the page but not run stream memory operations on it
            stream_write(stream.cuda_stream, words, 0)
            stream_wait(stream.cuda_stream, words, 0)
            stream.synchronize()
        except RuntimeError as e:
            log.warning("GPU waits on mailbox words unavailable (%s): same-GPU calls wait on the host", e)
            if stream is not None:
                drop_stream(self.device, stream)
            if words is not None:
                areas.box.unmap_words(self.device)
            return
        areas.words, areas.out_word, areas.stream = words, out_word, stream

    def _region(self, owner: Owner, nbytes: int):
        from symbiont.proto.cuda_ipc import DeviceRegion

        with self._lock:
            fit = [r for r in self._parked.get(owner, []) if r.nbytes >= nbytes]
            if fit:  # the same process had it: nothing of another tenant's is in it
                best = min(fit, key=lambda r: r.nbytes)
                self._parked[owner].remove(best)
                return best
        return DeviceRegion.allocate(self.device, nbytes)

    def retire(self, areas: Areas, owner: Owner) -> None:
        """Any thread: the areas go out of use; release_retired() frees them later."""
        with self._lock:
            self._retired.append((areas, owner))

    def release_retired(self, drop_calls) -> None:
        """Data loop only, between batches. `drop_calls(data_area)` drops calls queued on it."""
        with self._lock:
            retired, self._retired = self._retired, []
        for areas, owner in retired:
            if areas.waiting() and owner_alive(owner):  # outgrown under a call: let that call finish
                with self._lock:
                    self._retired.append((areas, owner))
                continue
            drop_calls(areas.data)  # calls still queued read the area: they go first
            areas.lane = None  # (its counts were taken at retire; it holds an export of the mailbox)
            if areas.words:
                from symbiont.proto.cuda_ipc import drop_stream

                areas.release_wait()  # (its tenant is detached)
                while areas.programs and not areas.stream.query():  # (each queued run sets the program word back)
                    areas.box.release_program(output=False)
                    time.sleep(1e-4)
                areas.stream.synchronize()  # past its wait on the words page: nothing reads it then
                areas.programs.clear()  # (its programs go now, not with a garbage collection: graphs.capture_guard)
                areas.dropped = []
                torch.cuda.current_stream(self.device).synchronize()  # a result's word write may be queued there
                drop_stream(self.device, areas.stream)
                areas.stream = None
                areas.box.unmap_words(self.device)
            if areas.graphs is not None or areas.own_graphs is not None:
                torch.cuda.current_stream(self.device).synchronize()  # no replay still runs in their pool
                for graphs in (areas.graphs, areas.own_graphs):
                    if graphs is not None:
                        graphs.close()
                areas.graphs = areas.own_graphs = None
            if areas.pinned:
                from symbiont.proto.cuda_ipc import unpin_host

                torch.cuda.current_stream(self.device).synchronize()  # an input copy queued may still read it
                unpin_host(self.device, areas.pinned)
            areas.box.close()
            os.close(areas.fd)
            if areas.gpu is not None:
                if owner_alive(owner):
                    with self._lock:
                        self._parked.setdefault(owner, []).append(areas.gpu)
                else:
                    areas.gpu.free()

    def reap(self) -> None:
        """Data loop only: frees the parked regions of processes that are gone."""
        with self._lock:
            gone = [self._parked.pop(o) + [o] for o in list(self._parked) if not owner_alive(o)]
        for *regions, owner in gone:
            for region in regions:
                region.free()
            log.info("device mailboxes of process %d freed", owner[0])

    def has_retired(self) -> bool:
        """Whether any areas wait for release_retired() (a look without the lock: a race only
        delays them to the next turn of the data loop)."""
        return bool(self._retired)

    def any_waiting(self) -> bool:
        """Whether a retired area's stream may still wait for its tenant's input."""
        with self._lock:
            return any(areas.waiting() for areas, _ in self._retired)

    def held_bytes(self) -> int:
        """The bytes of areas out of use and not yet freed: retired (until the data loop releases
        them, which may wait for a stalled call) and parked device regions."""
        with self._lock:
            retired = sum(areas.total_bytes for areas, _ in self._retired)
            return retired + sum(r.nbytes for rs in self._parked.values() for r in rs)

    def close(self) -> None:
        """At shutdown, after release_retired(): every parked region goes."""
        with self._lock:
            parked, self._parked = self._parked, {}
        for regions in parked.values():
            for region in regions:
                region.free()
