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
"""
from __future__ import annotations

import dataclasses

import torch

from symbiont.base_executor.catalog import CONV1D, LINEAR, UnitTable
from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb

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
class Adapter:
    name: str
    id: int
    owner: int  # a tenant id, or PROVIDER
    deltas: dict[str, Delta]

    @property
    def nbytes(self) -> int:
        """What its weights take in the executor's memory."""
        return sum(t.numel() * t.element_size() for d in self.deltas.values() for t in (d.a, d.b))

    def info(self) -> pb.AdapterInfo:
        units = sorted(self.deltas)
        return pb.AdapterInfo(name=self.name, id=self.id, shared=self.owner == PROVIDER, units=units,
                              ranks=[self.deltas[u].a.shape[0] for u in units], bytes=self.nbytes)


class AdapterRegistry:
    def __init__(self, table: UnitTable, device: torch.device, max_tenant_bytes: int = 1 << 30):
        """max_tenant_bytes: what one tenant's adapters may take of the executor's memory together
        (the provider's are not counted)."""
        self.table, self.device, self.max_tenant_bytes = table, device, max_tenant_bytes
        self._by_id: dict[int, Adapter] = {}
        self._by_name: dict[tuple[int, str], Adapter] = {}  # (owner, name)
        self._next = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def bytes(self) -> int:
        return sum(a.nbytes for a in list(self._by_id.values()))  # (a copy: stats read it without the lock)

    # ---- adding and removing ----------------------------------------------------

    def host(self, owner: int, req: pb.HostAdapterRequest) -> Adapter:
        """Checks and keeps the adapter of a HostAdapterRequest; AdapterError naming what is wrong."""
        name = req.name
        if not name or len(name) > 200:
            raise AdapterError(pb.INVALID_ARGUMENT, "an adapter needs a name of 1 to 200 characters")
        if (owner, name) in self._by_name or (PROVIDER, name) in self._by_name:
            raise AdapterError(pb.INVALID_ARGUMENT, f"an adapter named {name!r} is already hosted")
        if len(self._by_id) >= MAX_ADAPTERS:
            raise AdapterError(pb.RESOURCE_EXHAUSTED, f"the executor hosts {MAX_ADAPTERS} adapters already")
        if not req.weights:
            raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} has no weights")
        if owner != PROVIDER:
            held = sum(a.nbytes for a in self._by_id.values() if a.owner == owner)
            size = sum(len(w.a) + len(w.b) for w in req.weights)
            if held + size > self.max_tenant_bytes:
                raise AdapterError(pb.RESOURCE_EXHAUSTED, f"adapter {name!r} needs {size} bytes; this tenant's adapters hold "
                                                          f"{held} of the {self.max_tenant_bytes} it may (--max-tenant-adapter-mb)")
        deltas = {}
        for w in req.weights:
            if w.unit in deltas:
                raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {name!r} gives unit {w.unit!r} twice")
            deltas[w.unit] = self._delta(name, w)
        adapter = Adapter(name, self._next, owner, deltas)
        self._next += 1
        self._by_id[adapter.id] = adapter
        self._by_name[(owner, name)] = adapter
        return adapter

    def _delta(self, name: str, w: pb.AdapterWeight) -> Delta:
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
        size = dtype.itemsize
        for what, data, shape in (("A", w.a, (r, unit.in_features)), ("B", w.b, (unit.out_features, r))):
            if len(data) != shape[0] * shape[1] * size:
                raise AdapterError(pb.SHAPE_MISMATCH, f"{where}: {what} must be {list(shape)} {codec.NAME_OF[dtype]}, "
                                                      f"got {len(data)} bytes")
        scale = float(w.scale)
        if not torch.isfinite(torch.tensor(scale)):
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: scale {scale} is not finite")
        a = torch.frombuffer(bytearray(w.a), dtype=dtype).view(r, unit.in_features).to(self.device)
        b = torch.frombuffer(bytearray(w.b), dtype=dtype).view(unit.out_features, r).to(self.device)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(pb.INVALID_ARGUMENT, f"{where}: weights hold NaN or infinity")
        return Delta(a, b, scale)

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

    def _drop(self, adapter: Adapter) -> None:
        del self._by_id[adapter.id]
        del self._by_name[(adapter.owner, adapter.name)]

    # ---- using ----------------------------------------------------------------------

    def visible(self, owner: int, name: str = "") -> list[Adapter]:
        found = [a for a in self._by_id.values() if a.owner in (owner, PROVIDER) and (not name or a.name == name)]
        if name and not found:
            raise AdapterError(pb.INVALID_ARGUMENT, f"no adapter named {name!r} is hosted for this tenant")
        return found

    def delta(self, owner: int, adapter_id: int, unit):
        """What a call of `owner` naming adapter `adapter_id` at `unit` gets: the unit's Delta, or
        for a fused group (q/k/v, gate/up) a GroupDelta of its adapted members."""
        adapter = self._by_id.get(adapter_id)
        if adapter is None or adapter.owner not in (owner, PROVIDER):
            raise AdapterError(pb.INVALID_ARGUMENT, f"no adapter with id {adapter_id} is hosted for this tenant")
        if unit.members and unit.kind in (LINEAR, CONV1D):
            parts = [(m.rows[0], m.rows[1], adapter.deltas[m.id]) for m in unit.members if m.id in adapter.deltas]
            if parts:
                return GroupDelta(parts)
        found = adapter.deltas.get(unit.id)
        if found is None:
            raise AdapterError(pb.INVALID_ARGUMENT, f"adapter {adapter.name!r} has nothing for unit {unit.id!r}")
        return found
