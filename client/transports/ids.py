"""Embedding ids a tenant sends into a data area on the executor's GPU, checked on the tenant's side.

The executor looks such ids up clamped to the table's rows (base_executor/runner.py) instead of
reading their bounds on its host first: that read waited for a host synchronisation at the start
of every decoding token, in the data loop every tenant shares. A bad id reads a row of the table,
never memory beyond it; that it was bad is this side's to tell. Ids in host memory are checked on
the host before the call goes. Ids in GPU memory have their lowest and highest copied to host
memory on the caller's stream, behind the call, and are checked once that copy is done: at the
next call when it is done by then (it waits for nothing), and at confirm(), which virtualize()
runs at the end of every forward pass (the copy of that pass's first call is long done by then).
The failure is an InvalidCallError with the message the executor gives for ids it checks itself.
"""
from __future__ import annotations

import collections

import torch

from symbiont.client.errors import InvalidCallError


def ids_error(unit: str, rows: int, low: int, high: int) -> InvalidCallError | None:
    """The error of ids whose lowest is `low` and highest `high`, for a table of `rows` rows (None: fine)."""
    if low < 0 or high >= rows:
        return InvalidCallError(f"ids for {unit!r} must lie in [0, {rows}), got [{low}, {high}]")
    return None


class IdsChecks:
    """The ids checks of one tenant's calls into a data area on the executor's GPU."""

    def __init__(self, rows: dict[str, int]):
        self.rows = rows  # embedding unit id -> its number of rows (the executor's catalog)
        self._pending: collections.deque = collections.deque()  # (unit, rows, bounds, event), in call order
        self._free: list = []  # (bounds, event) pairs whose checks are done: reused, never reallocated

    def _rows_of(self, unit: str) -> int | None:
        return self.rows.get(unit.partition("@")[0])  # (UNIT@ADAPTER: a hosted adapter's call)

    def check_now(self, unit: str, ids: torch.Tensor) -> None:
        """Ids in host memory: raises InvalidCallError now when one lies outside the unit's rows."""
        rows = self._rows_of(unit)
        if rows is None or not ids.numel():
            return
        low, high = torch.aminmax(ids.reshape(-1))
        error = ids_error(unit, rows, int(low), int(high))
        if error is not None:
            raise error

    def queue(self, unit: str, ids: torch.Tensor) -> None:
        """Ids in GPU memory: their bounds are copied to host memory on the current stream, to be
        checked by raise_done(). No host synchronisation."""
        rows = self._rows_of(unit)
        if rows is None or not ids.numel():
            return
        if self._free:
            bounds, event = self._free.pop()
        else:
            bounds, event = torch.empty(2, dtype=torch.int64, pin_memory=True), torch.cuda.Event()
        bounds.copy_(torch.stack(torch.aminmax(ids.reshape(-1))), non_blocking=True)  # [lowest, highest]
        event.record()
        self._pending.append((unit, rows, bounds, event))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def raise_done(self, wait: bool = False) -> None:
        """Raises the first failure among the queued checks whose copy is done (wait: waits for
        every copy first); each check is done once, raised or not."""
        while self._pending:
            unit, rows, bounds, event = self._pending[0]
            if not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            self._free.append((bounds, event))
            low, high = bounds.tolist()
            error = ids_error(unit, rows, low, high)
            if error is not None:
                raise error
