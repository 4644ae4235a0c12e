"""Embedding ids a tenant sends into a data area on the executor's GPU, checked on the tenant's side.

The executor looks such ids up clamped to the table's rows (base_executor/runner.py) instead of
reading their bounds on its host first: that read waited for a host synchronisation at the start
of every decoding token, in the data loop every tenant shares. A bad id reads a row of the table,
never memory beyond it; that it was bad is this side's to tell, so the executor trusts the tenant's
transport with it (a client that skips the check only gets rows of the table for its bad ids). Ids
in host memory are checked on the host before the call goes. Ids in GPU memory have their lowest
and highest copied to page-locked host memory on the ids' stream as the call goes, and are checked
once that copy is done: at the next call when it is done by then (it waits for nothing), and at
confirm(), which virtualize() runs at the end of every forward pass. The failure is an
InvalidCallError with the message the executor gives for ids it checks itself; as with the calls'
own failures, a forward raises its first (the checks of its other calls are dropped with it).
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from symbiont.client.errors import InvalidCallError
from symbiont.proto import codec


def ids_error(unit: str, rows: int, low: int, high: int) -> InvalidCallError | None:
    """The error of ids whose lowest is `low` and highest `high`, for a table of `rows` rows (None: fine)."""
    message = codec.ids_out_of_range(unit, rows, low, high)
    return None if message is None else InvalidCallError(message)


@dataclasses.dataclass(slots=True)
class _Check:
    call_id: int
    unit: str
    rows: int
    device: torch.device  # the ids' GPU
    bounds: torch.Tensor  # [lowest, highest], page-locked
    event: torch.cuda.Event  # recorded after the copy into bounds


def _rows_of(rows: dict[str, int], unit: str) -> int | None:
    return rows.get(unit.partition("@")[0])  # (UNIT@ADAPTER: a hosted adapter's call)


class IdsChecks:
    """The ids checks of one tenant's calls into a data area on the executor's GPU. `rows`: each
    embedding unit's number of rows, from the executor's catalog (Transport.embedding_rows). Used
    under the transport's lock only."""

    def __init__(self):
        self._pending: collections.deque[_Check] = collections.deque()  # in call order
        self._free: dict[torch.device, list] = {}  # (bounds, event) of checks done, by the ids' GPU: reused

    def check_now(self, rows: dict[str, int], unit: str, ids: torch.Tensor) -> None:
        """Ids in host memory: raises InvalidCallError now when one lies outside the unit's rows."""
        n = _rows_of(rows, unit)
        if n is None or not ids.numel():
            return
        low, high = torch.aminmax(ids.reshape(-1))
        error = ids_error(unit, n, int(low), int(high))
        if error is not None:
            raise error

    def queue(self, rows: dict[str, int], unit: str, ids: torch.Tensor, call_id: int) -> None:
        """Ids in GPU memory, of call `call_id`: their bounds are copied to host memory on the
        current stream of their GPU, to be checked by raise_done(). No host synchronisation."""
        n = _rows_of(rows, unit)
        if n is None or not ids.numel():
            return
        free = self._free.setdefault(ids.device, [])
        with torch.cuda.device(ids.device):
            if free:
                bounds, event = free.pop()
            else:  # (made under inference_mode it could not be written outside it, when reused)
                with torch.inference_mode(False):
                    bounds = torch.empty(2, dtype=torch.int64, pin_memory=True)
                event = torch.cuda.Event()
            bounds.copy_(torch.stack(torch.aminmax(ids.reshape(-1))), non_blocking=True)
            event.record(torch.cuda.current_stream(ids.device))
        self._pending.append(_Check(call_id, unit, n, ids.device, bounds, event))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def forget(self, call_id: int) -> None:
        """Drops the check of a call that failed (its own failure is what the caller sees)."""
        if any(c.call_id == call_id for c in self._pending):
            self._pending = collections.deque(c for c in self._pending if c.call_id != call_id)

    def raise_done(self, wait: bool = False) -> None:
        """Raises the first failure among the checks whose copy is done (wait: waits for every
        copy first); the checks queued after a failure are dropped with it. Each check is done
        once, raised or not."""
        while self._pending:
            c = self._pending[0]
            if not c.event.query():
                if not wait:
                    return
                c.event.synchronize()
            self._pending.popleft()
            error = ids_error(c.unit, c.rows, *c.bounds.tolist())
            self._free[c.device].append((c.bounds, c.event))
            if error is not None:
                self._pending.clear()  # (their copies may still run: their buffers are not reused)
                raise error

    def clear(self) -> None:
        """Forgets every check (the tenant detached, or the executor is gone)."""
        self._pending.clear()
