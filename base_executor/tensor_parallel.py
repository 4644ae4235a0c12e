"""Tensor parallelism (`--placement tensor`): every rank holds a slice of every unit's weight, rank 0
serves the tenants and runs each batch over all ranks with torch.distributed's collectives.

Slices: a Linear's weight [out, in] and an Embedding's [num, dim] by rows, a Conv1D's [in, out] by
columns, in `world` even ranges: rank r holds the output features (vocabulary rows) [a_r, b_r). A
group unit's members are row ranges of the group's weight, so each rank holds its rows of the
group once and a member's call uses the rows of it that fall in the rank's range. A tied Linear
(lm_head) shares its embedding's row slice.

One call: rank 0 broadcasts a header (unit, op, shape) and the input; each rank computes its part:
- FORWARD: its output columns (a row slice's GEMM: each output element is the same dot product as
  unsplit; bitwise the unsplit result where the GEMM library sums it in the same order for the
  narrower matrix, as in the tests at 2 and 4 ranks; 3 CPU ranks with unfused q/k/v calls were
  1.8e-7 off); an Embedding looks up the ids in its range and rank 0 takes each token's row from
  the rank that owns it (bitwise);
- BACKWARD: grad_y's columns it owns times its rows, [tokens, in], summed over the ranks by rank 0
  in rank order (a sum in another order than one GEMM's: equal to rounding, not bitwise).
Parts travel by `gather` to rank 0, padded to one width. Gated-MLP units are not served under this
placement (their forward would need a reduction); tenants call their Linears.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from symbiont.base_executor.catalog import CONV1D, EMBEDDING, LINEAR, MLP, Unit, UnitTable
from symbiont.base_executor.core import Unavailable
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")

STOP = -1
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s even share [a, b) of n rows."""
    per, extra = divmod(n, world)
    a = rank * per + min(rank, extra)
    return a, a + per + (1 if rank < extra else 0)


class TensorParallel:
    """One rank's slices of every unit and the collectives of one call (rank 0 leads, the others
    follow). Every rank must build it from the same table, in the same order."""

    def __init__(self, table: UnitTable, rank: int, world: int, device: torch.device):
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.device = dist, rank, world, device
        self.broken = ""  # why the ranks fell out of step (a call failed between its collectives)
        table.keep(u for u, unit in table.units.items() if unit.kind != MLP)
        self.units = list(table.units.values())  # (the index a header names)
        self.index = {u.id: i for i, u in enumerate(self.units)}
        groups = {u.id: u for u in self.units if u.members}
        # every rank's [lo, hi) of each unit's output columns (an embedding's: its rows), computed once
        self.bounds = {u.id: [self._columns(u, groups, r) for r in range(world)] for u in self.units}
        # an embedding: the first id of ranks 1.., which tells the rank that owns an id
        self.starts = {u.id: torch.tensor([lo for lo, _ in self.bounds[u.id][1:]], device=device)
                       for u in self.units if u.kind == EMBEDDING}
        mine: dict[int, torch.Tensor] = {}  # id(owner's full weight) -> this rank's slice of it
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # unit -> (weight slice, bias slice)
        for u in self.units:
            self.parts[u.id] = self._part(u, groups, mine)
        for u in self.units:  # the full tensors go: only the slices stay
            u.weight = None
            u.bias = None

    @staticmethod
    def _owner(u: Unit, groups: dict[str, Unit]) -> tuple[Unit, int, int, int]:
        """The unit whose weight holds u's rows (its group, or u), its number of rows (an embedding's
        vocabulary, a Linear's outputs), and u's rows [m0, m1) of it."""
        owner = groups[u.group] if u.group else u
        n = owner.in_features if owner.kind == EMBEDDING else owner.out_features
        return (owner, n, *u.rows) if u.group else (owner, n, 0, n)

    def _columns(self, u: Unit, groups: dict[str, Unit], rank: int) -> tuple[int, int]:
        """Rank `rank`'s [lo, hi) of u's output columns: its even share of the owner's rows, within u's."""
        _, n, m0, m1 = self._owner(u, groups)
        a, b = rows_of(n, self.world, rank)
        lo, hi = max(a, m0), min(b, m1)
        return (lo - m0, hi - m0) if lo < hi else (0, 0)

    def _part(self, u: Unit, groups: dict[str, Unit], mine: dict[int, torch.Tensor]):
        """u's part on this rank: (weight slice, bias slice), views of the owner's slice held once."""
        owner, n, m0, _ = self._owner(u, groups)
        full = owner.weight
        a, b = rows_of(n, self.world, self.rank)
        if id(full) not in mine:
            mine[id(full)] = (full[:, a:b] if owner.kind == CONV1D else full[a:b]).contiguous().to(self.device)
        c0, c1 = self.bounds[u.id][self.rank]
        lo, hi = (c0 + m0 - a, c1 + m0 - a) if c1 > c0 else (0, 0)  # (within this rank's slice)
        w = mine[id(full)]
        w = w[:, lo:hi] if owner.kind == CONV1D else w[lo:hi]
        bias = None if u.bias is None else u.bias[c0:c1].contiguous().to(self.device)
        return w, bias

    def parameter_count(self) -> int:
        """The parameters of this rank's slices (each held once)."""
        seen, n = set(), 0
        for w, b in self.parts.values():
            for t in (w, b):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    n += t.numel()
        return n

    # ---- one call -------------------------------------------------------------------------

    def run(self, unit: Unit, op: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0: `op` of `unit` on x ([tokens, d_in]; ids [tokens]) over every rank. Raises
        Unavailable once a call failed between its collectives (a rank lost, most likely): the
        ranks are out of step from then on."""
        if self.broken:
            raise Unavailable(f"the executor's ranks are out of step since a call failed ({self.broken})")
        header = torch.tensor([self.index[unit.id], op, x.shape[0], x.shape[1] if x.dim() > 1 else -1,
                               _DTYPES.index(x.dtype)], dtype=torch.int64)
        try:
            self.dist.broadcast(header, src=0)
            self.dist.broadcast(x.contiguous(), src=0)
            y = self._collect(unit, op, x)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            raise Unavailable(f"a rank of the executor is lost or out of step: {self.broken}") from e
        if out is not None:
            out.copy_(y)
            return out
        return y

    def follow(self) -> None:
        """Ranks 1..: serve rank 0's calls until it says stop."""
        while True:
            header = torch.empty(5, dtype=torch.int64)
            self.dist.broadcast(header, src=0)
            index, op, tokens, width, dtype = header.tolist()
            if index == STOP:
                return
            shape = (tokens, width) if width >= 0 else (tokens,)
            x = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
            self.dist.broadcast(x, src=0)
            self._collect(self.units[index], op, x)

    def stop(self) -> None:
        """Rank 0: ends the others' follow()."""
        self.dist.broadcast(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64), src=0)

    def _collect(self, unit: Unit, op: int, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's part, gathered at rank 0 (the result there; None elsewhere)."""
        w, b = self.parts[unit.id]
        bounds = self.bounds[unit.id]
        c0, c1 = bounds[self.rank]
        if unit.kind == EMBEDDING:
            local = x - c0  # (its rows are ids [c0, c1))
            part = F.embedding(local.clamp(0, c1 - c0 - 1), w) if c1 > c0 else x.new_zeros(x.shape[0], w.shape[1], dtype=w.dtype)
            parts = self._gather(part)
            if parts is None:
                return None
            owner = torch.searchsorted(self.starts[unit.id], x, right=True)
            return torch.stack(parts)[owner, torch.arange(x.shape[0], device=x.device)]
        if op == pb.BACKWARD:
            g = x[:, c0:c1]  # [tokens, my columns] @ my rows [cols, in] -> [tokens, in]
            part = torch.mm(g, w.t()) if unit.kind == CONV1D else torch.mm(g, w)
            parts = self._gather(part)
            if parts is None:
                return None
            y = parts[0].clone()
            for p in parts[1:]:
                y += p
            return y
        if unit.kind == LINEAR:
            part = F.linear(x, w, b if op == pb.FORWARD else None)
        elif unit.kind == CONV1D:
            part = torch.addmm(b, x, w) if op == pb.FORWARD and b is not None else torch.mm(x, w)
        else:
            raise ValueError(f"unit {unit.id} ({unit.kind}) does not support {pb.Op.Name(op)}")
        width = max(hi - lo for lo, hi in bounds)
        padded = part if part.shape[1] == width else F.pad(part, (0, width - part.shape[1]))
        parts = self._gather(padded.contiguous())
        if parts is None:
            return None
        return torch.cat([p[:, : hi - lo] for p, (lo, hi) in zip(parts, bounds)], dim=1)

    def _gather(self, part: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(part) for _ in range(self.world)] if self.rank == 0 else None
        self.dist.gather(part, parts, dst=0)
        return parts
