"""Tensor parallelism (`--placement tensor`): every rank holds a slice of every unit's weight, rank 0
serves the tenants and runs each batch over all ranks with torch.distributed's collectives.

Slices. A unit is split by its outputs (column-parallel) or, the down projection of a gated MLP,
by its inputs (row-parallel):
- column-parallel: a Linear's weight [out, in] and an Embedding's [num, dim] by rows, a Conv1D's
  [in, out] by columns, in `world` even ranges: rank r holds output features (vocabulary rows)
  [a_r, b_r). A group's members are row ranges of the group's weight, so each rank holds its rows
  of the group once and a member's call uses the rows of it that fall in the rank's range. A tied
  Linear (lm_head) shares its embedding's row slice.
- a gated MLP block (an MLP unit: its gate/up unit, then down) is Megatron's pair: rank r holds the
  intermediate features [a_r, b_r) of gate and of up (two row ranges of the gate/up unit, so rank
  r's outputs of that unit are two column ranges) and the same input columns of down. The block's
  forward is then local up to down's partial sum: act(gate_r x) * (up_r x) @ down_r^T, one reduction
  per block instead of gathering the [tokens, 2 x intermediate] activation.

One call: rank 0 broadcasts a header (unit, op, shape) and the input; each rank computes its part,
and the parts travel to rank 0 by `gather`, padded to one width:
- column-parallel FORWARD: its output columns (each output element the same dot product as unsplit:
  bitwise the unsplit result where the GEMM library sums the narrower matrix in the same order, as
  in the tests at 2 and 4 ranks); an Embedding looks up the ids in its range and rank 0 takes each
  token's row from the rank that owns it (bitwise); BACKWARD: grad_y's columns the rank owns times
  its rows, [tokens, in], summed by rank 0 in rank order (equal to rounding, not bitwise);
- row-parallel (down) FORWARD: its input columns times its columns of the weight, summed by rank 0
  in rank order, the bias added once (equal to rounding); BACKWARD: grad_y times its columns, which
  are the rank's columns of grad_x;
- an MLP unit's FORWARD and BACKWARD (recomputed from x, runner._mlp on the rank's slices): partial
  [tokens, hidden] results summed by rank 0 in rank order (equal to rounding).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from symbiont.base_executor import runner
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


@dataclasses.dataclass
class _Part:
    """One unit on this rank: its slice of the weight (and bias), and every rank's ranges of the
    unit's output columns (column-parallel) or input columns (row-parallel)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    ranges: list[list[tuple[int, int]]]  # per rank: [lo, hi) ranges, in the unit's own columns
    by_input: bool = False  # row-parallel: ranges are input columns
    mlp: Unit | None = None  # an MLP unit: its members on this rank's slices (runner._mlp runs it)


class TensorParallel:
    """One rank's slices of every unit and the collectives of one call (rank 0 leads, the others
    follow). Every rank must build it from the same table, in the same order."""

    def __init__(self, table: UnitTable, rank: int, world: int, device: torch.device, source=None):
        """source (LoadedModel.source): where the weights still on the meta device come from; only
        this rank's slice of each is made (models.make_part)."""
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.device = dist, rank, world, device
        self.source = source
        self.broken = ""  # why the ranks fell out of step (a call failed between its collectives)
        self.units = list(table.units.values())  # (the index a header names)
        self.index = {u.id: i for i, u in enumerate(self.units)}
        groups = {u.id: u for u in self.units if u.members and u.kind != MLP}
        # the gate/up unit and the down of every MLP unit: split by intermediate features
        self.paired: dict[str, Unit] = {}
        for u in self.units:
            if u.kind == MLP:
                pair, down = u.members
                self.paired[pair.id] = self.paired[down.id] = u
        # each owner's (a group's, or a unit's own) row ranges per rank, then its slice on this rank, held once
        owners = [o for o in self.units if not o.group and o.kind != MLP]
        self.rows = {o.id: [self._owner_rows(o, r) for r in range(world)] for o in owners}
        held: dict[int, torch.Tensor] = {}  # id(a full weight) -> this rank's slice (a tied lm_head shares its embedding's)
        mine: dict[str, torch.Tensor] = {}  # owner -> its slice on this rank
        for o in owners:
            if id(o.weight) not in held:
                held[id(o.weight)] = self._slice(o, self.rows[o.id][rank])
            mine[o.id] = held[id(o.weight)]
        self.parts: dict[str, _Part] = {}
        for u in self.units:
            if u.kind != MLP:
                self.parts[u.id] = self._part(u, groups, mine)
        for u in self.units:
            if u.kind == MLP:
                pair, down = u.members
                local_pair = dataclasses.replace(pair, weight=self.parts[pair.id].weight, bias=self.parts[pair.id].bias,
                                                 members=(), out_features=self.parts[pair.id].weight.shape[0])
                local_down = dataclasses.replace(down, weight=self.parts[down.id].weight, bias=None, group="",
                                                 in_features=self.parts[down.id].weight.shape[1])
                local = dataclasses.replace(u, members=(local_pair, local_down), act_mul=None)
                self.parts[u.id] = _Part(None, None if down.bias is None else down.bias.to(device), [], mlp=local)
        # an embedding: the first id of ranks 1.., which tells the rank that owns an id
        self.starts = {u.id: torch.tensor([p.ranges[r][0][0] for r in range(1, world)], device=device)
                       for u in self.units if u.kind == EMBEDDING for p in [self.parts[u.id]]}
        for u in self.units:  # the full tensors go: only the slices stay
            u.weight = None
            u.bias = None

    # ---- slices ------------------------------------------------------------------------------

    def _n_rows(self, owner: Unit) -> int:
        return owner.in_features if owner.kind == EMBEDDING else owner.out_features

    def _owner_rows(self, owner: Unit, rank: int) -> list[tuple[int, int]]:
        """Rank `rank`'s row ranges of an owner's weight (output features; a row-parallel down's: input features)."""
        mlp = self.paired.get(owner.id)
        if mlp is not None and owner is mlp.members[0]:  # gate/up: the rank's intermediate features of each
            width = owner.out_features // 2
            a, b = rows_of(width, self.world, rank)
            return [(a, b), (width + a, width + b)]
        if mlp is not None:  # down: its input features [a, b)
            return [rows_of(owner.in_features, self.world, rank)]
        return [rows_of(self._n_rows(owner), self.world, rank)]

    def _slice(self, owner: Unit, ranges: list[tuple[int, int]]) -> torch.Tensor:
        mlp = self.paired.get(owner.id)
        by_cols = owner.kind == CONV1D or (mlp is not None and owner is mlp.members[1])  # (a row-parallel down: its input columns)
        if owner.weight.is_meta:  # (a rank-read checkpoint or a lazy built-in: only this rank's part made)
            from symbiont.base_executor.models import make_part

            pieces = [make_part(owner, self.source, self.device, cols=r) if by_cols else make_part(owner, self.source, self.device, rows=r)
                      for r in ranges]
        else:
            pieces = [owner.weight[:, a:b] if by_cols else owner.weight[a:b] for a, b in ranges]
        return torch.cat(pieces, dim=1 if by_cols else 0).contiguous().to(self.device)

    def _part(self, u: Unit, groups: dict[str, Unit], mine: dict[str, torch.Tensor]) -> _Part:
        """u on this rank: the view of its owner's slice that is u's, and every rank's ranges of u's columns."""
        owner = groups[u.group] if u.group else u
        w = mine[owner.id]
        mlp = self.paired.get(owner.id)
        if mlp is not None and owner is mlp.members[1]:  # down: row-parallel, its input columns
            return _Part(w, u.bias.to(self.device) if u.bias is not None else None, self.rows[owner.id], by_input=True)
        m0, m1 = u.rows if u.group else (0, self._n_rows(u))
        ranges = []
        for r in range(self.world):  # the owner's rows of rank r that are u's, in u's columns
            ranges.append([(max(a, m0) - m0, min(b, m1) - m0) for a, b in self.rows[owner.id][r] if max(a, m0) < min(b, m1)])
        # u's rows within this rank's slice (a member's rows are one contiguous run of the owner's slice)
        offset, lo, hi = 0, None, None
        for a, b in self.rows[owner.id][self.rank]:
            s, e = max(a, m0), min(b, m1)
            if s < e:
                lo = offset + s - a if lo is None else lo
                hi = offset + e - a
            offset += b - a
        if lo is None:
            lo = hi = 0
        w = w[:, lo:hi] if owner.kind == CONV1D else w[lo:hi]
        bias = None
        if u.bias is not None:
            bias = torch.cat([u.bias[a:b] for a, b in ranges[self.rank]]) if ranges[self.rank] else u.bias[:0]
            bias = bias.contiguous().to(self.device)
        return _Part(w, bias, ranges)

    def parameter_count(self) -> int:
        """The parameters of this rank's slices (each held once)."""
        seen, n = set(), 0
        for p in self.parts.values():
            for t in (p.weight, p.bias):
                if t is not None and t.numel() and t.data_ptr() not in seen:
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
        p = self.parts[unit.id]
        if unit.kind == MLP:  # partial [tokens, hidden] sums: down's bias once, at rank 0
            if op not in (pb.FORWARD, pb.BACKWARD):
                raise ValueError(f"MLP unit {unit.id} does not support {pb.Op.Name(op)}")
            y = self._sum(runner.run(p.mlp, op, x))
            return y if y is None or op != pb.FORWARD or p.bias is None else y + p.bias
        w, b, mine = p.weight, p.bias, p.ranges[self.rank]
        if unit.kind == EMBEDDING:
            (c0, c1), = mine or [(0, 0)]
            local = x - c0  # (its rows are ids [c0, c1))
            part = F.embedding(local.clamp(0, c1 - c0 - 1), w) if c1 > c0 else x.new_zeros(x.shape[0], w.shape[1], dtype=w.dtype)
            parts = self._gather(part)
            if parts is None:
                return None
            owner = torch.searchsorted(self.starts[unit.id], x, right=True)
            return torch.stack(parts)[owner, torch.arange(x.shape[0], device=x.device)]
        if p.by_input:  # row-parallel (an MLP's down, called alone)
            (a, c), = mine
            if op == pb.BACKWARD:  # its columns of grad_x
                return self._assemble(torch.mm(x, w), p.ranges, x.shape[0])
            if op not in (pb.FORWARD, pb.FORWARD_NO_BIAS):
                raise ValueError(f"unit {unit.id} ({unit.kind}) does not support {pb.Op.Name(op)}")
            y = self._sum(F.linear(x[:, a:c], w))
            return y if y is None or op != pb.FORWARD or b is None else y + b
        if op == pb.BACKWARD:
            g = torch.cat([x[:, lo:hi] for lo, hi in mine], dim=1) if len(mine) > 1 else x[:, slice(*mine[0]) if mine else slice(0)]
            part = torch.mm(g, w.t()) if unit.kind == CONV1D else torch.mm(g, w)
            return self._sum(part)
        if unit.kind == LINEAR:
            part = F.linear(x, w, b if op == pb.FORWARD else None)
        elif unit.kind == CONV1D:
            part = torch.addmm(b, x, w) if op == pb.FORWARD and b is not None else torch.mm(x, w)
        else:
            raise ValueError(f"unit {unit.id} ({unit.kind}) does not support {pb.Op.Name(op)}")
        return self._assemble(part, p.ranges, x.shape[0])

    def _assemble(self, part: torch.Tensor, ranges: list[list[tuple[int, int]]], tokens: int) -> torch.Tensor | None:
        """Every rank's columns, gathered at rank 0 and put in their places."""
        widths = [sum(hi - lo for lo, hi in rs) for rs in ranges]
        width = max(widths)
        padded = part if part.shape[1] == width else F.pad(part, (0, width - part.shape[1]))
        parts = self._gather(padded.contiguous())
        if parts is None:
            return None
        y = part.new_empty(tokens, max((hi for rs in ranges for _, hi in rs), default=0))
        for piece, rs in zip(parts, ranges):
            at = 0
            for lo, hi in rs:
                y[:, lo:hi] = piece[:, at : at + hi - lo]
                at += hi - lo
        return y

    def _sum(self, part: torch.Tensor) -> torch.Tensor | None:
        """Every rank's part, summed at rank 0 in rank order (the same sum whatever the collective does)."""
        parts = self._gather(part.contiguous())
        if parts is None:
            return None
        y = parts[0].clone()
        for q in parts[1:]:
            y += q
        return y

    def _gather(self, part: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(part) for _ in range(self.world)] if self.rank == 0 else None
        self.dist.gather(part, parts, dst=0)
        return parts
