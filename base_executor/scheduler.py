"""Per-unit queues and opportunistic batching. No sockets, no threads: a pure object.

A queue (one per unit and op) is ready when its oldest call has waited long enough for its
latency class, when its queued tokens reach `max_batch_tokens`, or when no other call can
arrive before something runs (every attached tenant already waits on a call). Inference
queues go first. Calls batched at one unit owe nothing to each other at the next one.
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from symbiont.proto import executor_pb2 as pb


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_wait_us: int = 500
    """How long a training call may wait for others to join its batch."""
    inference_wait_us: int = 50
    """How long an inference call may wait (shorter: latency matters)."""
    max_batch_tokens: int = 8192
    """A queue with this many tokens runs at once."""
    exact: bool = False
    """Batch-invariant results: each call of a batch gets its own GEMM, so a tenant's results are
    bitwise what it would get alone (GEMM kernels reorder sums with the row count otherwise);
    a fused group's forward is one GEMM per member, bitwise what unfused calls would get."""

    def __post_init__(self):
        if self.max_wait_us < 0 or self.inference_wait_us < 0:
            raise ValueError(f"waits must be >= 0 (max_wait_us={self.max_wait_us}, inference_wait_us={self.inference_wait_us})")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


@dataclasses.dataclass(eq=False)
class Call:
    """One validated call, its input already a [tokens, d_in] tensor on the executor's device."""

    tenant: int
    call_id: int
    unit: object  # catalog.Unit
    op: int
    x: torch.Tensor
    out_shape: tuple[int, ...]
    latency: int
    arrived: float
    tag: object = None  # the transport's bookkeeping: where the result goes
    out: torch.Tensor | None = None  # [tokens, d_out]: where a call run alone may write its result (no copy)
    graphs: object = None  # graphs.CallGraphs that may run it when alone (its out set), and its key there
    graph_key: object = None

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._queues: dict[tuple[str, int], collections.deque[Call]] = {}
        self._tokens: collections.Counter = collections.Counter()
        self._inference: collections.Counter = collections.Counter()
        self._per_tenant: collections.Counter = collections.Counter()

    def submit(self, call: Call) -> None:
        key = (call.unit.id, call.op)
        self._queues.setdefault(key, collections.deque()).append(call)
        self._tokens[key] += call.tokens
        self._inference[key] += call.latency == pb.INFERENCE
        self._per_tenant[call.tenant] += 1

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_tenants(self) -> int:
        """Tenants with at least one queued call."""
        return len(self._per_tenant)

    def waiting(self, tenant: int) -> bool:
        """Whether `tenant` has a queued call."""
        return tenant in self._per_tenant

    def _wait_s(self, key) -> float:
        us = self.config.inference_wait_us if self._inference[key] else self.config.max_wait_us
        return us * 1e-6

    def next_deadline(self) -> float | None:
        return min((q[0].arrived + self._wait_s(k) for k, q in self._queues.items()), default=None)

    def pop_batch(self, now: float, can_grow: bool = True) -> list[Call]:
        """The calls to run now as one batch (same unit, same op), or [] when nothing is due.

        can_grow: False when no call can arrive before something runs, so waiting is pure loss.
        """
        best, best_rank = None, None
        for key, q in self._queues.items():
            due = (
                not can_grow
                or self._tokens[key] >= self.config.max_batch_tokens
                or now - q[0].arrived >= self._wait_s(key)
            )
            if due:
                rank = (0 if self._inference[key] else 1, q[0].arrived)
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
        if best is None:
            return []
        q = self._queues[best]
        batch = [q.popleft()]
        tokens = batch[0].tokens
        while q and tokens + q[0].tokens <= self.config.max_batch_tokens:
            tokens += q[0].tokens
            batch.append(q.popleft())
        for c in batch:
            self._tokens[best] -= c.tokens
            self._inference[best] -= c.latency == pb.INFERENCE
            self._per_tenant[c.tenant] -= 1
            if self._per_tenant[c.tenant] == 0:
                del self._per_tenant[c.tenant]
        if not q:
            del self._queues[best], self._tokens[best], self._inference[best]
        return batch

    def drop(self, predicate) -> int:
        """Forgets every queued call for which predicate(call) is true; returns how many."""
        dropped = 0
        for key in list(self._queues):
            keep = collections.deque()
            for c in self._queues[key]:
                if not predicate(c):
                    keep.append(c)
                    continue
                dropped += 1
                self._tokens[key] -= c.tokens
                self._inference[key] -= c.latency == pb.INFERENCE
                self._per_tenant[c.tenant] -= 1
                if self._per_tenant[c.tenant] == 0:
                    del self._per_tenant[c.tenant]
            if keep:
                self._queues[key] = keep
            else:
                del self._queues[key], self._tokens[key], self._inference[key]
        return dropped
