"""Hosted adapters: LoRA adapters the executor holds and adds to the calls that name them.

A hosted adapter is a set of per-unit low-rank deltas (A [r, in], B [out, r], scale) on linear
units. A call that names one gets, on its own rows of the batch it rides in,

    FORWARD, FORWARD_NO_BIAS   y      += scale * (x A^T) B^T
    BACKWARD                   grad_x += (scale * grad_y B) A

computed the way PEFT's LoRA layer computes it (in the adapter's dtype, then added to the base
result and rounded to the served dtype once), so a tenant naming an adapter gets what the same
adapter held privately gives. Adapters are frozen: no call computes their gradients.

A tenant's adapters are seen by that tenant alone and dropped when it leaves; the provider's
(`base-executor serve --adapters DIR`) are shared by every tenant. The registry checks every
delta against the served unit (kind, widths, rank) before it keeps anything.

Paging (S-LoRA's unified memory, at the granularity of adapters): with a pool budget
(`serve --adapter-pool-mb`), adapters are kept in page-locked host memory and copied to the
executor's device when a call names one that is not there (a miss), or ahead of its calls when a
tenant's model names it (`adapters` by name: prefetch). The least recently used are evicted
between batches once the resident ones pass the budget; the hit rate is in the stats.

Merged mode (VaLoRA's, for an adapter that dominates the traffic): the adapter is merged into
copies of the units it adapts, W' = W + scale B A (computed in float32, rounded once to the served
dtype, as PEFT's merge), and its calls there are a plain GEMM on W'. The served weights are never
written, so every other call (private tenants, other adapters, training) computes exactly what it
did before: no mixture correction is needed, at the cost of the adapted units' weights once
(`Merged.nbytes`). `MergeOrchestrator` chooses the adapter from the traffic. On a GPU the adapted
rows of every copy are written in one launch of kernels/lora_merge.py's kernel (each read once from
the served weight and written once), the other rows copied.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time

import torch

from symbiont.base_executor.catalog import CONV1D, LINEAR, SPAN, Unit, UnitTable
from symbiont.proto import codec, mailbox
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")
PROVIDER = 0  # the owner of shared adapters
MAX_RANK = 1024
MAX_ADAPTERS = 4096


class AdapterError(Exception):
    """An adapter that cannot be hosted or used; `code` is the Status code the caller gets."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Delta:
    """One unit's share of an adapter."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    def add_to(self, op: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds this delta's term for `op` on input rows x ([tokens, d_in]) to y ([tokens, d_out]) in place."""
        if self.a.is_cuda and not torch.cuda.is_current_stream_capturing():
            # read on this stream (the data loop's, a tenant's): the allocator must not hand the
            # weights' memory to anyone before it is done, whenever the last reference goes
            # (an adapter paged out or removed while a call of it is still queued on the GPU)
            stream = torch.cuda.current_stream(self.a.device)
            self.a.record_stream(stream)
            self.b.record_stream(stream)
        xa = x.to(self.a.device, self.a.dtype)
        if op == pb.BACKWARD:
            term = (xa * self.scale) @ self.b @ self.a
        else:
            term = (xa @ self.a.t()) @ self.b.t() * self.scale
        y.copy_(y + term)  # (PEFT's order: the base result plus the adapter's, in the wider dtype, rounded once)


@dataclasses.dataclass
class GroupDelta:
    """The deltas of a fused group's adapted members: each on the member's output columns [a, b)."""

    parts: list[tuple[int, int, Delta]]

    def add_to(self, op: int, x: torch.Tensor, y: torch.Tensor) -> None:
        for a, b, delta in self.parts:
            if op == pb.BACKWARD:  # (grad_y's columns of the member give its share of grad_x)
                delta.add_to(op, x[:, a:b], y)
            else:
                delta.add_to(op, x, y[:, a:b])


@dataclasses.dataclass
class SpanDelta:
    """A hosted adapter's deltas inside a layer span (proto/layer_span.py): at its o_proj and at the
    next layer's q/k/v group (None where it has none). runner._span adds each where its unit's own
    call would, on the span's intermediate results."""

    o: Delta | None
    qkv: GroupDelta | None


@dataclasses.dataclass
class Adapter:
    name: str
    id: int
    owner: int  # a tenant id, or PROVIDER
    deltas: dict[str, Delta]  # its weights: on the executor's device, or (paged) in page-locked host memory
    resident: dict[str, Delta] | None = None  # paged: its copy on the device, while it is there
    last_used: int = 0  # paged: when a call last named it (the registry's clock)

    @property
    def nbytes(self) -> int:
        """What its weights take."""
        return sum(t.numel() * t.element_size() for d in self.deltas.values() for t in (d.a, d.b))

    def info(self) -> pb.AdapterInfo:
        units = sorted(self.deltas)
        return pb.AdapterInfo(name=self.name, id=self.id, shared=self.owner == PROVIDER, units=units,
                              ranks=[self.deltas[u].a.shape[0] for u in units], bytes=self.nbytes)


@dataclasses.dataclass
class Merged:
    """An adapter merged into copies of the units it adapts."""

    adapter: Adapter
    epoch: int  # one per merge: graphs of an earlier merge's copies never match a later one's calls
    units: dict[str, Unit]  # by the called unit's id (a fused group, or a unit called alone)
    nbytes: int  # the copies' memory
    switch_s: float  # how long making them took


ARENA_ALIGN_BYTES = 256  # where each merged copy starts in the copies' arena


def _merged_unit(unit: Unit, parts: list[tuple[int, int, Delta]], adapted: list, weight: torch.Tensor | None = None) -> Unit | None:
    """A copy of `unit` with scale B A added to the output rows [a, b) of each part (None: no part),
    in `weight` (the unit's shape and strides; default a new tensor). Rows no part adapts are copied
    now; the adapted rows' (served rows, copy's rows, delta) are appended to `adapted`, for
    _merge_rows to write."""
    if not parts:
        return None
    source = unit.weight if unit.kind == LINEAR else unit.weight.t()  # [out, in] either way
    weight = torch.empty_like(unit.weight) if weight is None else weight
    rows = weight if unit.kind == LINEAR else weight.t()
    done = 0
    for a, b, delta in sorted(parts, key=lambda p: p[0]):
        if a > done:
            rows[done:a].copy_(source[done:a])
        adapted.append((source[a:b], rows[a:b], delta))
        done = b
    if done < rows.shape[0]:
        rows[done:].copy_(source[done:])
    base = unit.weight.storage_offset()
    members = tuple(dataclasses.replace(m, weight=weight.as_strided(m.weight.shape, m.weight.stride(),
                                                                     weight.storage_offset() + m.weight.storage_offset() - base))
                    for m in unit.members)
    return dataclasses.replace(unit, weight=weight, members=members)


def _arena_for(todo: list[tuple[Unit, list]], device: torch.device) -> tuple[torch.Tensor | None, list[int]]:
    """One block of memory for every merged copy of `todo` ((unit, parts) each), and where each
    copy starts in it (elements; _places makes the views). (None, []) where the copies cannot
    share one (weights of several dtypes or not contiguous, or no free block that large): each is
    then made alone."""
    dtypes = {u.weight.dtype for u, _ in todo}
    if len(dtypes) != 1 or not all(u.weight.is_contiguous() for u, _ in todo):
        return None, []
    dtype = dtypes.pop()
    step = max(1, ARENA_ALIGN_BYTES // dtype.itemsize)
    at, places = 0, []
    for u, _ in todo:
        places.append(at)
        at += -(-u.weight.numel() // step) * step
    try:
        arena = torch.empty(at, dtype=dtype, device=device)
    except torch.cuda.OutOfMemoryError:  # (fragmented: the copies one by one may still fit)
        return None, []
    return arena, places


def _places(arena: torch.Tensor | None, starts: list[int], todo: list[tuple[Unit, list]]) -> list:
    """Each copy's view of the arena, of its unit's shape (None each without an arena)."""
    if arena is None:
        return [None] * len(todo)
    return [arena[a : a + u.weight.numel()].view(u.weight.shape) for a, (u, _) in zip(starts, todo)]


def _cached_plan(plans: dict, key) -> object | None:
    """The plan `_merge_rows` kept for `key` (adapter id, its device deltas dict, the arena's size):
    made for the same adapter's same device copies into an arena of the same layout, and covering
    every adapted row; None if there is none."""
    entry = plans.get(key[0])
    return entry[2] if entry is not None and entry[0] is key[1] and entry[1] == key[2] else None


def _merge_rows(parts: list[tuple[torch.Tensor, torch.Tensor, Delta]], kernel: bool,
                arena: torch.Tensor | None = None, plans: dict | None = None, key=None) -> None:
    """Writes out = served + scale B A (accumulated in float32, rounded once) for every (served
    rows, out rows, delta) of `parts`. With `kernel` (a GPU), the rows contiguous along their inputs
    in one launch of the merge kernel, each read once and written once (one read and one write of
    the unit, the least a copy can cost); the others, and all without it, by one addmm each (ATen
    writes such rows twice). With `arena` (every out row range a view of it), the kernel's plan holds
    the outs' places in the arena, so it serves every later merge of the same rows: `plans` keeps it
    under `key` (see _cached_plan) when it wrote every row."""
    rest = parts
    if kernel:
        rows = [p for p in parts if p[0].stride(1) == 1 and p[1].stride(1) == 1]
        try:
            if rows:
                from symbiont.base_executor.kernels.lora_merge import merge_lora_, plan_merge

                dtype = rows[0][0].dtype
                loras = [(d.a.to(dtype).contiguous(), d.b.to(dtype), d.scale) for _, _, d in rows]
                plan = plan_merge([w for w, _, _ in rows], loras, outs=[o for _, o, _ in rows], arena=arena)
                merge_lora_(plan, arena)
                if plans is not None and arena is not None and len(rows) == len(parts):
                    plans.clear()
                    plans[key[0]] = (key[1], key[2], plan)
            rest = [p for p in parts if not (p[0].stride(1) == 1 and p[1].stride(1) == 1)]
        except (ImportError, ValueError, TypeError) as e:  # (no Triton, rows or ranks the kernel does not take)
            log.debug("merged copies by addmm: %s", e)
        except Exception as e:  # (the kernel failed to build or launch: Triton out of resources, ...) the exact way
            log.warning("merged copies by addmm: the merge kernel failed (%s: %s)", type(e).__name__, e)
    for w, o, d in rest:
        torch.addmm(w, d.b.to(o.dtype), d.a.to(o.dtype), alpha=d.scale, out=o)


class AdapterRegistry:
    def __init__(self, table: UnitTable, device: torch.device, max_tenant_bytes: int = 1 << 30, pool_bytes: int = 0):
        """max_tenant_bytes: what one tenant's adapters may take of the executor's memory together
        (the provider's are not counted). pool_bytes: what hosted adapters may take of the device
        together; beyond it they are paged (0: every adapter stays on the device)."""
        self.table, self.device, self.max_tenant_bytes, self.pool_bytes = table, device, max_tenant_bytes, pool_bytes
        self._paging = threading.Lock()  # residency: the data loop, the control thread and gRPC's resolve calls
        self._clock = 0
        self._copy_stream = None  # a GPU executor's stream for paging adapters in
        self.hits = self.misses = self.evictions = 0
        self._resident = 0  # paged: the device copies' bytes
        self._paged_in = False  # an adapter was paged in since the last eviction
        self._by_id: dict[int, Adapter] = {}
        self._by_name: dict[tuple[int, str], Adapter] = {}  # (owner, name)
        self._next = 1
        self.merged: Merged | None = None
        self.dropped_merge = False  # the merged adapter was removed: its copies' graphs are still to drop
        self.merge_kernel = True  # a GPU's merged copies by the one-launch kernel, else an addmm each (probes/merge_switch.py)
        # the last merged adapter's kernel plan (_merge_rows); it holds that adapter's device A and B
        # (converted copies where the adapter's dtype is not the served one: uncounted by the pool, adapter-sized)
        self._merge_plans: dict[int, tuple] = {}
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, adapter_id: int) -> Adapter | None:
        return self._by_id.get(adapter_id)

    @property
    def merged_adapter(self) -> Adapter | None:
        """The adapter merged now (merged mode), if any."""
        merged = self.merged
        return merged.adapter if merged is not None else None

    def bytes(self) -> int:
        return sum(a.nbytes for a in list(self._by_id.values()))  # (a copy: stats read it without the lock)

    def resident_bytes(self) -> int:
        """What hosted adapters take on the device now."""
        return self._resident if self.pool_bytes else self.bytes()

    # ---- paging ---------------------------------------------------------------------

    def on_device(self, adapter: Adapter, count: bool = True) -> dict[str, Delta]:
        """The adapter's deltas on the executor's device: paged in first when it is not there
        (a miss: a copy the caller's host waits for, never a GPU stall of other work)."""
        if not self.pool_bytes:
            return adapter.deltas
        with self._paging:
            self._clock += 1
            adapter.last_used = self._clock
            if adapter.resident is not None:
                self.hits += count
                return adapter.resident
            self.misses += count
            copies = self._page_in(adapter)
            self._paged_in = True
            if self._by_id.get(adapter.id) is adapter:  # (removed meanwhile: the call gets it, the pool does not)
                adapter.resident = copies
                self._resident += adapter.nbytes
            return copies

    def touch(self, adapter_id: int, calls: int) -> None:
        """`calls` calls of a native lane named the adapter: hits, and it is recent."""
        if not self.pool_bytes:
            return
        with self._paging:
            self.hits += calls
            adapter = self._by_id.get(adapter_id)
            if adapter is not None:
                self._clock += 1
                adapter.last_used = self._clock

    def _page_in(self, adapter: Adapter) -> dict[str, Delta]:
        if self.device.type != "cuda":
            return {u: Delta(d.a.clone(), d.b.clone(), d.scale) for u, d in adapter.deltas.items()}
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            copies = {u: Delta(d.a.to(self.device, non_blocking=True), d.b.to(self.device, non_blocking=True), d.scale)
                      for u, d in adapter.deltas.items()}
        self._copy_stream.synchronize()  # (ready for every stream; only this copy is waited for)
        return copies

    def prefetch(self, adapter: Adapter) -> None:
        """Pages `adapter` in ahead of its calls (a tenant's model names it)."""
        if self.pool_bytes:
            self.on_device(adapter, count=False)

    def over_budget(self) -> bool:
        return bool(self.pool_bytes) and self.resident_bytes() > self.pool_bytes

    def needs_eviction(self) -> bool:
        """Over budget since an adapter was last paged in (cheap: the data loop asks every turn)."""
        return self._paged_in and self.over_budget()

    def evict(self, before=None) -> list[Adapter]:
        """Drops the device copies of the least recently used adapters until the resident ones fit
        the pool (never the merged one); returned, for the caller to drop what else refers to them
        (graphs). before(): called first when there is any to drop (the caller's GPU synchronise:
        no queued work may read them), never when there is none."""
        with self._paging:
            self._paged_in = False
            merged = self.merged_adapter
            over, evicted = self._resident - self.pool_bytes, []
            for adapter in sorted((a for a in self._by_id.values() if a.resident is not None), key=lambda a: a.last_used):
                if over <= 0:
                    break
                if adapter is not merged:
                    evicted.append(adapter)
                    over -= adapter.nbytes
            if evicted and before is not None:
                before()
            for adapter in evicted:
                adapter.resident = None
                self._resident -= adapter.nbytes
                self._merge_plans.pop(adapter.id, None)  # (its plan holds the device copies)
            self.evictions += len(evicted)
        return evicted

    # ---- adding and removing ----------------------------------------------------

    def host(self, owner: int, req: pb.HostAdapterRequest) -> Adapter:
        """Checks and keeps the adapter of a HostAdapterRequest; AdapterError naming what is wrong."""
        name = req.name
        if not name or len(name) > 200:
            raise AdapterError(pb.INVALID_ARGUMENT, "an adapter needs a name of 1 to 200 characters")
        if (owner, name) in self._by_name or (PROVIDER, name) in self._by_name or (
                owner == PROVIDER and any(a.name == name for a in self._by_id.values())):
            raise AdapterError(pb.INVALID_ARGUMENT, f"an adapter named {name!r} is already hosted")
        if len(self._by_id) >= MAX_ADAPTERS:
            raise AdapterError(pb.RESOURCE_EXHAUSTED, f"the executor hosts {MAX_ADAPTERS} adapters already")
        if not req.weights:
            raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} has no weights")
        checked = {}  # unit -> (A, B, scale): read-only views of the request's bytes, checked
        for w in req.weights:
            if w.unit in checked:
                raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} gives unit {w.unit!r} twice")
            checked[w.unit] = self._checked(name, w)
        if owner != PROVIDER:
            held = sum(a.nbytes for a in self._by_id.values() if a.owner == owner)
            size = sum(t.nbytes for a, b, _ in checked.values() for t in (a, b))
            if held + size > self.max_tenant_bytes:
                raise AdapterError(pb.RESOURCE_EXHAUSTED, f"adapter {name!r} needs {size} bytes; this tenant's adapters hold "
                                                          f"{held} of the {self.max_tenant_bytes} it may (--max-tenant-adapter-mb)")
        adapter = Adapter(name, self._next, owner, self._deltas(checked))
        self._next += 1
        self._by_id[adapter.id] = adapter
        self._by_name[(owner, name)] = adapter
        return adapter

    def _checked(self, name: str, w: pb.AdapterWeight) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One unit's weights checked against the served unit, as read-only views of the request's
        bytes (each field read once: every read of a bytes field makes a copy): (A, B, scale)."""
        unit = self.table.get(w.unit)
        where = f"adapter {name!r}, unit {w.unit!r}"
        if unit is None:
            raise AdapterError(pb.UNKNOWN_UNIT, f"{where}: no such unit is served")
        if unit.kind not in (LINEAR, CONV1D) or unit.members:
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: a {unit.kind} unit; adapters go on linear units")
        r = int(w.rank)
        if not 0 < r <= MAX_RANK:
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: rank {r} is not in 1..{MAX_RANK}")
        dtype = codec.TORCH_OF.get(w.dtype)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise AdapterError(pb.DTYPE_MISMATCH, f"{where}: weights must be float32, bfloat16 or float16")
        pair = []
        for what, data, shape in (("A", w.a, (r, unit.in_features)), ("B", w.b, (unit.out_features, r))):
            if len(data) != shape[0] * shape[1] * dtype.itemsize:
                raise AdapterError(pb.SHAPE_MISMATCH, f"{where}: {what} must be {list(shape)} {codec.NAME_OF[dtype]}, "
                                                      f"got {len(data)} bytes")
            pair.append(codec.from_bytes(data, shape, dtype, copy=False))
        scale = float(w.scale)
        if not torch.isfinite(torch.tensor(scale)):
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: scale {scale} is not finite")
        if not all(torch.isfinite(t).all() for t in pair):
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: weights hold NaN or infinity")
        return pair[0], pair[1], scale

    def _deltas(self, checked: dict) -> dict[str, Delta]:
        """The checked weights (_checked) as Deltas: on the device, or (paged on a GPU) in one
        page-locked block for the whole adapter (page-locking each tensor alone cost about 2 ms
        apiece: 64 of them for q and v of a 16-layer model), else in host memory of their own."""
        pinned = bool(self.pool_bytes) and self.device.type == "cuda"
        if pinned:  # (each weight at a 64-byte boundary of the block)
            sizes = [mailbox.align(t.nbytes) for a, b, _ in checked.values() for t in (a, b)]
            block = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
            starts = iter(itertools.accumulate([0] + sizes))
        deltas = {}
        for unit, (a, b, scale) in checked.items():
            pair = []
            for t in (a, b):
                if pinned:
                    at = next(starts)
                    pair.append(block[at: at + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
                elif not self.pool_bytes and self.device.type != "cpu":
                    pair.append(t.to(self.device))
                else:
                    pair.append(t.clone())  # (memory of its own: the request's bytes are read-only)
            deltas[unit] = Delta(pair[0], pair[1], scale)
        return deltas

    def remove(self, owner: int, name: str) -> Adapter:
        adapter = self._by_name.get((owner, name))
        if adapter is None:
            shared = (PROVIDER, name) in self._by_name
            raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} is the provider's: a tenant cannot remove it" if shared
                               else f"no adapter named {name!r} is hosted for this tenant")
        self._drop(adapter)
        return adapter

    def drop_owner(self, owner: int) -> None:
        """Drops a tenant's adapters (it left)."""
        for adapter in [a for a in self._by_id.values() if a.owner == owner]:
            self._drop(adapter)

    def clear(self) -> None:
        """Drops every adapter and the merged copies (the executor stops). A GPU executor's weights
        read on several streams must go while the CUDA context lives: their memory's last uses are
        recorded there, and freeing it at interpreter exit, after the context, aborts the process."""
        for adapter in list(self._by_id.values()):
            self._drop(adapter)
        self.merged, self.dropped_merge = None, False
        self._merge_plans.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _drop(self, adapter: Adapter) -> None:
        with self._paging:
            if adapter.resident is not None:
                adapter.resident = None
                self._resident -= adapter.nbytes
        del self._by_id[adapter.id]
        del self._by_name[(adapter.owner, adapter.name)]
        self._merge_plans.pop(adapter.id, None)
        if self.merged_adapter is adapter:
            self.merged = None
            self.dropped_merge = True  # (the data loop drops what refers to its copies: local_calls._orchestrate)

    # ---- merged mode --------------------------------------------------------------------

    def merge(self, adapter_id: int) -> Merged:
        """Merges adapter `adapter_id` into copies of the units it adapts (unmerging any other);
        its calls at those units get the copy from then on. The served weights stay as they are."""
        adapter = self._by_id[adapter_id]
        t0 = time.perf_counter()
        deltas = self.on_device(adapter, count=False)
        todo: list[tuple[Unit, list]] = []  # (unit to copy, its adapted row ranges)
        covered: set[str] = set()
        for unit in self.table.units.values():  # groups first: a member called alone reads its group's copy
            if unit.members and unit.kind in (LINEAR, CONV1D):
                parts = [(m.rows[0], m.rows[1], deltas[m.id]) for m in unit.members if m.id in deltas]
                if parts:
                    todo.append((unit, parts))
                    covered.update(m.id for m in unit.members if m.id in deltas)
        for unit_id, delta in deltas.items():
            unit = self.table.get(unit_id)
            if unit_id not in covered and unit is not None:
                todo.append((unit, [(0, unit.out_features, delta)]))
        kernel = self.device.type == "cuda" and self.merge_kernel
        arena, starts = _arena_for(todo, self.device) if kernel else (None, [])
        key = (adapter.id, deltas, arena.numel() if arena is not None else 0)
        plan = _cached_plan(self._merge_plans, key) if arena is not None else None
        if plan is not None:  # the GPU writes the adapted rows while the host describes the copies below
            from symbiont.base_executor.kernels.lora_merge import merge_lora_

            try:
                merge_lora_(plan, arena)
            except Exception as e:  # (made anew below, by _merge_rows, which falls back to addmm)
                log.warning("merge of adapter %r: its kept plan failed (%s); planning again", adapter.name, e)
                self._merge_plans.pop(adapter.id, None)
                plan = None
        units: dict[str, Unit] = {}
        adapted: list = []  # (served rows, copy's rows, delta) of every adapted row range
        for (unit, parts), place in zip(todo, _places(arena, starts, todo)):  # (views made after the launch)
            merged = _merged_unit(unit, parts, adapted, place)  # (rows no part adapts: copied here)
            units[unit.id] = merged
            if unit.members:
                units.update((m.id, m) for m in merged.members if m.id in deltas)
        if plan is None:
            _merge_rows(adapted, kernel=kernel, arena=arena, plans=self._merge_plans, key=key)
            if self._by_id.get(adapter.id) is not adapter:  # (removed meanwhile: _drop may have run before the plan was kept)
                self._merge_plans.pop(adapter.id, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (the switch's time is the copies' time)
        self._epoch += 1
        nbytes = sum(u.weight.numel() * u.weight.element_size() for u in units.values() if not u.group or u.group not in units)
        self.merged = Merged(adapter, self._epoch, units, nbytes, time.perf_counter() - t0)
        return self.merged

    def unmerge(self) -> Merged | None:
        """Back to every adapter computed per call; the merged copies go (returned, for the
        transports to drop what refers to them)."""
        merged, self.merged = self.merged, None
        return merged

    # ---- using ----------------------------------------------------------------------

    def visible(self, owner: int, name: str = "") -> list[Adapter]:
        """The adapters `owner` may use (its own and the provider's; the provider sees all)."""
        found = [a for a in self._by_id.values()
                 if (owner == PROVIDER or a.owner in (owner, PROVIDER)) and (not name or a.name == name)]
        if name and not found:
            raise AdapterError(pb.INVALID_ARGUMENT, f"no adapter named {name!r} is hosted for this tenant")
        return found

    def resolve(self, owner: int, adapter_id: int, unit: Unit) -> tuple[Unit, object, int]:
        """What a call of `owner` naming `adapter_id` (0: none) at `unit` runs: (the unit to
        compute, the delta to add or None, the merge epoch when the unit is a merged copy, else 0)."""
        if not adapter_id:
            return unit, None, 0
        delta = self.delta(owner, adapter_id, unit)  # (checks that owner may use it)
        merged = self.merged
        if merged is not None and merged.adapter.id == adapter_id:
            if unit.kind == SPAN:  # (its o_proj and q/k/v: the merged copies)
                return _merged_span(merged, unit), None, merged.epoch
            copy = merged.units.get(unit.id)
            if copy is not None:
                return copy, None, merged.epoch
        return unit, delta, 0

    def delta(self, owner: int, adapter_id: int, unit):
        """What a call of `owner` naming adapter `adapter_id` at `unit` gets: the unit's Delta, or
        for a fused group (q/k/v, gate/up) a GroupDelta of its adapted members."""
        adapter = self._by_id.get(adapter_id)
        if adapter is None or adapter.owner not in (owner, PROVIDER):
            raise AdapterError(pb.INVALID_ARGUMENT, f"no adapter with id {adapter_id} is hosted for this tenant")
        deltas = self.on_device(adapter)
        if unit.kind == SPAN:
            return _span_delta(unit, deltas, adapter.name)
        if unit.members and unit.kind in (LINEAR, CONV1D):
            parts = [(m.rows[0], m.rows[1], deltas[m.id]) for m in unit.members if m.id in deltas]
            if parts:
                return GroupDelta(parts)
        found = deltas.get(unit.id)
        if found is None:
            raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {adapter.name!r} has nothing for unit {unit.id!r}")
        return found


def _span_delta(unit: Unit, deltas: dict[str, Delta], name: str) -> SpanDelta:
    """The deltas of an adapter inside span `unit`: its o_proj's and its next q/k/v group's; an
    adapter of the MLP between them is refused (its layer makes its own calls then)."""
    o, mlp, *qkv = unit.members
    inside = {u.id for m in mlp.members for u in (m, *m.members)}
    if inside & deltas.keys():
        raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} adapts the MLP inside span {unit.id!r}: "
                                                "its layer calls its units one by one")
    parts = [(m.rows[0], m.rows[1], deltas[m.id]) for m in qkv[0].members if m.id in deltas] if qkv else []
    found = SpanDelta(deltas.get(o.id), GroupDelta(parts) if parts else None)
    if found.o is None and found.qkv is None:
        raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} has nothing for unit {unit.id!r}")
    return found


def _merged_span(merged: Merged, unit: Unit) -> Unit:
    """Span `unit` computing with the merged copies of its o_proj and q/k/v where the merged
    adapter has them (made once per merge)."""
    span = merged.units.get(unit.id)
    if span is None:
        o, mlp, *qkv = unit.members
        members = (merged.units.get(o.id, o), mlp, *(merged.units.get(q.id, q) for q in qkv))
        span = merged.units[unit.id] = dataclasses.replace(unit, members=members)
    return span


def merge_bytes(table: UnitTable, adapter: Adapter) -> int:
    """What merging `adapter` would take: the weights of the units it adapts (a fused group's whole)."""
    groups, total = set(), 0
    for unit_id in adapter.deltas:
        unit = table.get(unit_id)
        if unit is None:
            continue
        owner = table.get(unit.group) if unit.group else None
        if owner is not None:
            if owner.id not in groups:
                groups.add(owner.id)
                total += owner.weight.numel() * owner.weight.element_size()
        else:
            total += unit.weight.numel() * unit.weight.element_size()
    return total


class MergeOrchestrator:
    """Chooses which hosted adapter to merge, from the tokens the calls naming each carried.

    Every `window_s`: the adapter with the most tokens is merged when its share of all the tokens of
    calls that named an adapter is at least `share` and the window saw `min_tokens` of them; the
    merged adapter is unmerged when its share falls below `share / 2` (hysteresis: a share near the
    threshold does not flap), or replaced by another that reaches `share`. A merge that would take
    more than `max_bytes` is not made. VaLoRA's orchestrator weighs merged mode against the calls
    it starves (credits); merged copies starve no one (every other call runs as before), so the
    choice is only whether an adapter's traffic is worth its copies' memory and switch."""

    def __init__(self, share: float = 0.5, window_s: float = 2.0, min_tokens: int = 256, max_bytes: int = 4 << 30):
        if not 0 < share <= 1:
            raise ValueError(f"merge share must be in (0, 1], got {share}")
        if window_s <= 0:
            raise ValueError(f"merge window must be > 0 s, got {window_s}")
        self.share, self.window_s, self.min_tokens, self.max_bytes = share, window_s, min_tokens, max_bytes
        self.tokens: collections.Counter = collections.Counter()  # this window's, by adapter id
        self.window_start: float | None = None
        self.switches = 0
        self.last_switch_s = 0.0
        self.merged_tokens = 0  # tokens of calls served by merged copies, ever
        self.adapted_tokens = 0  # tokens of calls that named an adapter, ever

    def note(self, adapter_id: int, tokens: int, merged: bool = False) -> None:
        self.tokens[adapter_id] += tokens
        self.adapted_tokens += tokens
        self.merged_tokens += tokens if merged else 0

    def due(self, now: float) -> bool:
        if self.window_start is None:
            self.window_start = now
        return now - self.window_start >= self.window_s

    def decide(self, now: float, merged_id: int, fits) -> int | None:
        """At the end of a window: the adapter id to merge (0: unmerge), or None for no change.
        fits(adapter_id): whether its copies may be made (max_bytes, and that it is still hosted)."""
        counts, self.tokens, self.window_start = self.tokens, collections.Counter(), now
        total = sum(counts.values())
        current = counts.get(merged_id, 0) / total if total else 0.0
        if total >= self.min_tokens:
            for top, n in counts.most_common(2):
                if top != merged_id and n / total >= self.share and n > counts.get(merged_id, 0) and fits(top):
                    return top
        if merged_id and current < self.share / 2:
            return 0
        return None

    def switched(self, seconds: float) -> None:
        self.switches += 1
        self.last_switch_s = seconds
