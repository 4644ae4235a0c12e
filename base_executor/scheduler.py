"""Per-unit queues, batching policies and admission. No sockets, no threads: a pure object.

One queue per unit and op. When a queue is ready depends on the policy (Symbiosis, Table 4):
- opportunistic (the default): when its oldest call has waited its latency class's wait, when its
  queued tokens reach `max_batch_tokens`, or when no other call can arrive before something runs
  (the transport says so through `can_grow`: only tenants that called lately may join, and with
  `convoys` only at the queues they are expected at). Calls batched at one unit owe nothing to
  each other at the next one, so tenants that left a unit together tend to reach the next together.
- lockstep: only when every attached tenant has a call in it (or the tokens reach the cap, or
  every tenant waits somewhere else too: then the oldest queue runs, so nothing deadlocks; or its
  oldest call has waited `lockstep_wait_us`: a tenant whose next input its GPU holds back behind
  another tenant's queued call cannot stall everyone).
- no-lockstep: at once; a batch holds only the calls that arrived together.

Each tenant's calls run in the order it sent them: only a tenant's oldest queued call may join a
batch (its next call's input may be computed from this one's output, on the GPU, behind the host's
back), so a batch holds at most one call per tenant.

Convoys: a tenant's calls go round the same units in the same order (a model's layers, forward
then backward), so the scheduler learns, per tenant, which (unit, op)s its next call went to after
each (unit, op); a tenant with no call queued is expected next at the successors of its latest
call's (`expected`). With `convoys` on, a queue waits only for tenants expected at it: a call that no
one is about to join runs at once, and calls that ran together wait for each other at the next unit.

Catching up: a tenant may queue calls ahead of its GPU (a same-GPU tenant's, taken before their
inputs are in: transports/local.py, `gpu_batches`), so a tenant's later calls already sit in the
queues behind its oldest. A queue that such a later call of another tenant will reach waits for it
(up to `catch_up_us` from when its oldest call could first run): the tenant behind runs its calls
up to that unit meanwhile, and from there the two go on together. A call's waits count from when
it could first run (it became its tenant's oldest), not from when it was queued.

Inference queues go first, except that a queue whose oldest call has waited `starve_us` goes
before any younger one of the other class: neither class starves the other.

Admission: a call over its tenant's quota of queued calls or tokens, or arriving while the queues
hold `max_queued_tokens`, is refused (`Refused`, with a hint when to retry), never queued.
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from symbiont.proto import executor_pb2 as pb


POLICIES = ("opportunistic", "lockstep", "no-lockstep")
WAIT_WINDOW = 4096  # queue waits kept per class for their percentiles
MAX_SUCCESSORS = 4  # a (unit, op) followed by more distinct ones in a tenant's calls predicts nothing


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    policy: str = "opportunistic"
    """When a queue runs: opportunistic | lockstep | no-lockstep (module docstring)."""
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
    starve_us: int = 20_000
    """A queue whose oldest call waited this long goes before younger queues of the other class."""
    lockstep_wait_us: int = 100_000
    """Under lockstep, a queue whose oldest call waited this long runs without the missing tenants."""
    max_tenant_calls: int = 0
    """Calls one tenant may have queued at once; more are refused with RETRY_LATER (0: no limit)."""
    max_tenant_tokens: int = 0
    """Tokens one tenant may have queued at once; more are refused with RETRY_LATER (0: no limit)."""
    max_queued_tokens: int = 0
    """Tokens queued over all tenants past which new calls are refused with RETRY_LATER (0: no limit)."""
    catch_up_us: int = 0
    """Opportunistic: how long a queue that another tenant's queued later call will reach waits
    for it (module docstring, catching up); 0: never (serve's default with --gpu-batches: 1000)."""
    convoys: bool = False
    """Opportunistic: a queue waits only for tenants expected at it (`Scheduler.expected`); False: for
    any tenant that called lately, wherever it goes next (the default: on a busy GPU a wait costs
    nothing and the batches it makes save GEMMs; benchmarks/RESULTS.md, S10 convoys)."""

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("starve_us", "lockstep_wait_us", "catch_up_us", "max_tenant_calls", "max_tenant_tokens", "max_queued_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
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
    adapter: object = None  # adapters.Delta of the hosted adapter the call names, added to its result
    adapter_id: int = 0  # the hosted adapter it names (0: none)
    budget_s: float = 0.0  # its latency budget (CallRequest.budget_us): refused when it would wait longer (0: none)
    merge_epoch: int = 0  # its unit is that adapter's merged copy, of this merge (adapters.Merged)
    before: object = None  # called on the stream that runs it, before its input is read (a transport's GPU wait for it)
    head_at: float = 0.0  # when it became its tenant's oldest queued call (when it could first run)

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class Refused(Exception):
    """A call the scheduler will not queue now: over a quota, the queues are full (RETRY_LATER),
    or it would wait past its latency budget (OVER_BUDGET)."""

    def __init__(self, message: str, retry_after_s: float, code: int = pb.RETRY_LATER):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._queues: dict[tuple[str, int], collections.deque[Call]] = {}
        self._tokens: collections.Counter = collections.Counter()
        self._inference: collections.Counter = collections.Counter()
        self._per_tenant: collections.Counter = collections.Counter()
        self._tenant_tokens: collections.Counter = collections.Counter()
        self._order: dict[int, collections.deque[Call]] = {}  # each tenant's queued calls, oldest first
        self._behind: dict[tuple, collections.Counter] = {}  # (unit, op) -> tenant -> its queued calls there, not its oldest
        self.queued_tokens = 0
        self.waits_us = {pb.TRAINING: collections.deque(maxlen=WAIT_WINDOW), pb.INFERENCE: collections.deque(maxlen=WAIT_WINDOW)}
        self._rate = 0.0  # tokens per second the queues drain at, smoothed (the retry hint)
        self._wait_ema = {pb.TRAINING: 0.0, pb.INFERENCE: 0.0}  # seconds each class's calls waited lately (budgets)
        self._last_pop = None
        self._latest: dict[int, tuple] = {}  # each tenant's latest call's (unit, op), while known
        self._follows: dict[int, dict[tuple, frozenset | None]] = {}  # tenant: (unit, op) -> where its next calls went

    def admit(self, call: Call) -> None:
        """Raises Refused when `call` may not be queued now (quotas, a saturated executor)."""
        c = self.config
        why = None
        if c.max_tenant_calls and self._per_tenant[call.tenant] >= c.max_tenant_calls:
            why = f"tenant {call.tenant} already has {self._per_tenant[call.tenant]} calls queued (quota {c.max_tenant_calls})"
        elif c.max_tenant_tokens and self._tenant_tokens[call.tenant] + call.tokens > c.max_tenant_tokens:
            why = (f"tenant {call.tenant} has {self._tenant_tokens[call.tenant]} tokens queued; {call.tokens} more pass its "
                   f"quota of {c.max_tenant_tokens}")
        elif c.max_queued_tokens and self.queued_tokens + call.tokens > c.max_queued_tokens:
            why = f"the executor is saturated: {self.queued_tokens} tokens queued (at most {c.max_queued_tokens})"
        if why is not None:
            raise Refused(why, self.retry_after_s(call.tenant))
        # A call's expected wait: what its class's calls waited lately, or how long the oldest one
        # queued now has waited, if longer (a stuck queue shows before it runs), while anything is
        # queued (the queues empty, it runs as soon as its batch forms). Lockstep waits for tenants,
        # not for work: a budget would refuse the very call the queues wait for, so it is not checked there.
        if call.budget_s and self.queued_tokens and c.policy != "lockstep":
            expected = max(self._wait_ema[call.latency], self._oldest_wait(call.latency, call.arrived))
            if expected > call.budget_s:
                raise Refused(f"calls of its class waited ~{expected * 1e3:.3f} ms lately with {self.queued_tokens} tokens "
                              f"queued, past the call's budget of {call.budget_s * 1e3:.3f} ms", self.retry_after_s(), pb.OVER_BUDGET)

    def _oldest_wait(self, latency: int, now: float) -> float:
        """How long the oldest queued call of the class `latency` has waited at `now` (0.0: none queued)."""
        oldest = min((c.arrived for q in self._queues.values() for c in q if c.latency == latency), default=now)
        return max(0.0, now - oldest)

    def retry_after_s(self, tenant: int | None = None) -> float:
        """About how long the queued tokens (`tenant`'s, or everyone's) take to drain."""
        queued = self.queued_tokens if tenant is None else max(self._tenant_tokens[tenant], self.queued_tokens // 4)
        return min(1.0, max(1e-4, queued / self._rate if self._rate > 0 else 1e-3))

    def submit(self, call: Call) -> None:
        self.admit(call)
        key = (call.unit.id, call.op)
        self._queues.setdefault(key, collections.deque()).append(call)
        self._tokens[key] += call.tokens
        self._inference[key] += call.latency == pb.INFERENCE
        self._per_tenant[call.tenant] += 1
        self._tenant_tokens[call.tenant] += call.tokens
        order = self._order.setdefault(call.tenant, collections.deque())
        call.head_at = call.arrived  # (catching up: set again when it becomes its tenant's oldest)
        if order:
            self._behind.setdefault(key, collections.Counter())[call.tenant] += 1
        order.append(call)
        self.queued_tokens += call.tokens

    def note_call(self, tenant: int, key: tuple) -> None:
        """Tenant's next call is at `key` (unit id, op): learnt as its previous call's successor.
        The transport tells every call it sees, run through the queues or not."""
        last = self._latest.get(tenant)
        self._latest[tenant] = key
        if last is None or last == key:  # (a call split in chunks, or retried: the tenant is where it was)
            return
        follows = self._follows.setdefault(tenant, {})
        seen = follows.get(last, frozenset())
        if seen is not None and key not in seen:
            follows[last] = seen | {key} if len(seen) < MAX_SUCCESSORS else None

    def lost_track(self, tenant: int) -> None:
        """Tenant's calls went by unseen (a native lane served them): where it is now is unknown."""
        self._latest.pop(tenant, None)

    def forget_others(self, live) -> None:
        """Forgets what was learnt of the tenants not in `live` (detached) with no call queued."""
        for tenant in [t for t in self._follows.keys() | self._latest.keys() if t not in live and t not in self._per_tenant]:
            self._latest.pop(tenant, None)
            self._follows.pop(tenant, None)

    def expected(self, tenant: int) -> frozenset | None:
        """The (unit, op)s tenant's next call is expected at: where its calls went after its latest
        call's (unit, op) before; None when that is not known (any queue may get it)."""
        last = self._latest.get(tenant)
        if last is None:
            return None
        return self._follows.get(tenant, {}).get(last)

    def head_keys(self) -> set[tuple]:
        """The (unit, op)s of the queues holding a call that may run now."""
        return {(c.unit.id, c.op) for c in self._heads()}

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_tenants(self) -> int:
        """Tenants with at least one queued call."""
        return len(self._per_tenant)

    def waiting(self, tenant: int) -> bool:
        """Whether `tenant` has a queued call."""
        return tenant in self._per_tenant

    def _wait_s(self, key) -> float:
        if self.config.policy != "opportunistic":  # no-lockstep: none; lockstep: the tenants, or its bound
            return 0.0 if self.config.policy == "no-lockstep" else self.config.lockstep_wait_us * 1e-6
        us = self.config.inference_wait_us if self._inference[key] else self.config.max_wait_us
        return us * 1e-6

    def _heads(self) -> set[Call]:
        """The calls that may run now: each tenant's oldest queued one."""
        return {order[0] for order in self._order.values()}

    def next_deadline(self) -> float | None:
        heads = self._heads()
        d = min((c.head_at + self._wait_s(k) for k, q in self._queues.items() for c in q if c in heads), default=None)
        if d is not None and self._catching_up():  # (a queue may wait for a tenant behind: look again when that ends)
            d = min(d, min(c.head_at for c in heads) + self.config.catch_up_us * 1e-6)
        return None if d == float("inf") else d

    def _catching_up(self) -> bool:
        """Whether a queue may wait for a tenant behind (module docstring): some tenant has more
        than one call queued, under the opportunistic policy with catch_up_us."""
        return self.config.policy == "opportunistic" and bool(self.config.catch_up_us) and len(self._per_tenant) < self.pending()

    def pop_batch(self, now: float, can_grow: bool | set = True, attached: int = 0) -> list[Call]:
        """The calls to run now as one batch (same unit, same op), or [] when nothing is due.

        can_grow: False when no call can arrive before something runs, so waiting is pure loss; a
        set: only the queues of those (unit, op)s may get another call.
        attached: how many tenants are attached (lockstep waits for all of them at a queue); when
        every one of them has a call queued, no call can join: nothing waits.
        """
        if attached and len(self._per_tenant) >= attached:
            can_grow = False
        best, best_rank, best_ready = None, None, None
        starve = self.config.starve_us * 1e-6
        heads = self._heads()
        every = len(heads) == self.pending()
        catch_up = self.config.catch_up_us * 1e-6 if self._catching_up() else 0.0
        for key, q in self._queues.items():
            ready = list(q) if every else [c for c in q if c in heads]
            if not ready:
                continue
            waited = now - min(c.head_at for c in ready)
            due = (
                not (key in can_grow if isinstance(can_grow, set) else can_grow)
                or self._tokens[key] >= self.config.max_batch_tokens
                or waited >= self._wait_s(key)
                or (self.config.policy == "lockstep" and len(ready) >= attached)
            )
            if due and waited < catch_up and self._tokens[key] < self.config.max_batch_tokens and self._behind_at(key, ready):
                due = False  # a tenant behind has a call queued for it: it catches up meanwhile
            if due:
                # inference first, unless a queue has waited past starve_us: then the oldest first
                rank = (0 if self._inference[key] or now - ready[0].arrived >= starve else 1, ready[0].arrived)
                if best_rank is None or rank < best_rank:
                    best, best_rank, best_ready = key, rank, ready
        if best is None:
            return []
        batch = [best_ready[0]]
        tokens = batch[0].tokens
        for c in best_ready[1:]:
            if tokens + c.tokens > self.config.max_batch_tokens:
                break
            if (c.before is None) != (batch[0].before is None):
                continue  # (a call whose input the GPU waits for joins only others of its kind: the transport's)
            tokens += c.tokens
            batch.append(c)
        q = self._queues[best]
        if len(batch) == len(q):
            q.clear()
        else:
            taken = set(batch)
            self._queues[best] = q = collections.deque(c for c in q if c not in taken)
        for c in batch:
            self._forget(best, c, now)
            waited = now - c.head_at  # (from when it could run: a call queued behind its tenant's earlier ones waits for those first)
            self.waits_us[c.latency].append(waited * 1e6)
            self._wait_ema[c.latency] = 0.8 * self._wait_ema[c.latency] + 0.2 * waited
        if not q:
            del self._queues[best], self._tokens[best], self._inference[best]
        if self._last_pop is not None and now > self._last_pop:
            rate = tokens / max(now - self._last_pop, 1e-5)
            self._rate = rate if self._rate == 0 else 0.9 * self._rate + 0.1 * rate
        self._last_pop = now
        return batch

    def _forget(self, key, c: Call, now: float | None = None) -> None:
        self._tokens[key] -= c.tokens
        self._inference[key] -= c.latency == pb.INFERENCE
        self.queued_tokens -= c.tokens
        self._per_tenant[c.tenant] -= 1
        self._tenant_tokens[c.tenant] -= c.tokens
        order = self._order[c.tenant]
        if order[0] is c:
            order.popleft()
            if order:  # (its next call may run from now on)
                n = order[0]
                if self.config.catch_up_us and now is not None:  # (else waits count from arrival, as always)
                    n.head_at = max(n.arrived, now)
                self._unbehind((n.unit.id, n.op), n.tenant)
        else:
            order.remove(c)
            self._unbehind(key, c.tenant)
        if self._per_tenant[c.tenant] == 0:
            del self._per_tenant[c.tenant], self._tenant_tokens[c.tenant], self._order[c.tenant]

    def _behind_at(self, key, ready: list[Call]) -> bool:
        """Whether a tenant other than those of `ready` has a later call queued at `key`."""
        behind = self._behind.get(key)
        if not behind:
            return False
        here = {c.tenant for c in ready}
        return any(t not in here for t in behind)

    def _unbehind(self, key, tenant: int) -> None:
        behind = self._behind[key]
        behind[tenant] -= 1
        if not behind[tenant]:
            del behind[tenant]
            if not behind:
                del self._behind[key]

    def queued(self, tenant: int) -> int:
        """How many calls of `tenant` are queued."""
        return self._per_tenant.get(tenant, 0)

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
                self._forget(key, c)
            if keep:
                self._queues[key] = keep
            else:
                del self._queues[key], self._tokens[key], self._inference[key]
        return dropped
