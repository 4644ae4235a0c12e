"""A provider's live view of an executor: `base-executor stats URL [--watch S]` and the Prometheus
endpoint of `serve --metrics-port N`. Both read the same StatsReply (proto/executor.proto).

Rates (calls/s, tokens/s, TFLOP/s) come from two readings: the one-shot table takes them a second
apart, `--watch` between its refreshes; the Prometheus figures are counters, rated by the scraper.
"""
from __future__ import annotations

import time

from google.protobuf.descriptor import FieldDescriptor

from symbiont.base_executor.provider import request
from symbiont.base_executor.transports.call_paths import LATE, NATIVE
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import urls

_NUMBERS = frozenset({FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT32,
                      FieldDescriptor.CPPTYPE_UINT64, FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT})
"""StatsReply's fields that merged() sums or takes the largest of."""
BUCKETS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33+")  # calls per batch (ClassStats.batch_calls)
CLASS_NAMES = {pb.TRAINING: "training", pb.INFERENCE: "inference"}


def fetch(url: str, timeout_s: float = 5.0) -> pb.StatsReply:
    """One StatsReply from the executor serving `url` (no attach: stats need no tenant)."""
    if urls.parse(url)[0] != "local":
        raise ValueError(f"{url}: the provider's stats come from the executor's host (base-executor stats local://NAME); "
                         "over gRPC a tenant's connect(...).stats() shows the totals and its own row")
    return request(url, pb.ControlRequest(stats=pb.StatsRequest()), timeout_s, what="stats").stats


def table(now: pb.StatsReply, before: pb.StatsReply | None = None, seconds: float = 0.0) -> str:
    """The provider's table: totals and rates, each class's batches and waits, each tenant."""
    rate = (lambda a, b: (a - b) / seconds) if before is not None and seconds > 0 else None
    lines = [
        f"policy {now.policy or 'opportunistic'} | up {now.uptime_s:.0f} s | tenants {now.tenants} | "
        f"queued {now.queued_calls} calls, {now.queued_tokens} tokens | refused {now.refused} | errors {now.errors}",
        f"calls {now.calls} | batches {now.batches} | tokens {now.tokens} | "
        f"{now.calls / max(now.batches, 1):.2f} calls per batch | hosted adapters {now.hosted_adapters} "
        f"({now.adapter_bytes / 2**20:.1f} MiB), {now.adapter_calls} calls named one",
    ]
    if now.adapter_misses or now.adapter_evictions:
        looked = now.adapter_hits + now.adapter_misses
        lines.append(f"adapter pool {now.adapter_resident_bytes / 2**20:.1f} MiB on the device | hit rate "
                     f"{now.adapter_hits / max(looked, 1):.1%} ({now.adapter_misses} misses) | {now.adapter_evictions} evictions")
    if now.merge_switches or now.merged_adapter:
        lines.append(f"merged adapter {now.merged_adapter or '-'} ({now.merged_bytes / 2**20:.1f} MiB of copies) | "
                     f"{now.merge_switches} switches, the last {now.merge_switch_ms:.1f} ms | "
                     f"{now.merged_tokens} tokens served merged")
    if rate is not None:
        lines.append(
            f"now: {rate(now.calls, before.calls):.0f} calls/s, {rate(now.tokens, before.tokens):.0f} tokens/s, "
            f"{rate(now.flops, before.flops) / 1e12:.2f} TFLOP/s"
        )
    else:
        lines.append(f"since start: {now.flops / max(now.uptime_s, 1e-9) / 1e12:.3f} TFLOP/s")
    lines.append(paths_line(now, before))
    lines.append(
        f"memory: executor GPU {now.gpu_allocated_bytes / 2**30:.2f} GiB allocated, {now.gpu_reserved_bytes / 2**30:.2f} GiB "
        f"reserved; mailboxes {now.mailbox_bytes / 2**20:.1f} MiB; host private {now.rss_anon_bytes / 2**20:.0f} MiB"
    )
    lines.append(f"{'class':<10} {'calls':>9} {'batches':>9} {'queued p50 us':>14} {'p99 us':>9} {'refused':>8}  calls per batch: "
                 + " ".join(f"{b:>6}" for b in BUCKETS))
    for c in now.classes:
        lines.append(f"{CLASS_NAMES.get(c.latency, c.latency):<10} {c.calls:>9} {c.batches:>9} {c.wait_p50_us:>14.0f} "
                     f"{c.wait_p99_us:>9.0f} {c.refused:>8}  {'':16}" + " ".join(f"{n:>6}" for n in c.batch_calls))
    if now.tenant_stats:
        lines.append(f"{'tenant':>6} {'name':<24} {'pid':>8} {'placement':<9} {'calls':>9} {'calls/s':>8} {'queued':>6} "
                     f"{'mailbox MiB':>11} {'refused':>7}")
        old = {t.tenant_id: t for t in before.tenant_stats} if before is not None else {}
        for t in now.tenant_stats:
            cps = f"{rate(t.calls, old[t.tenant_id].calls):.0f}" if rate is not None and t.tenant_id in old else "-"
            lines.append(f"{t.tenant_id:>6} {t.name[:24]:<24} {t.pid:>8} {t.placement:<9} {t.calls:>9} {cps:>8} "
                         f"{t.queued_calls:>6} {t.mailbox_bytes / 2**20:>11.1f} {t.refused:>7}")
    return "\n".join(lines)


def paths_line(now: pb.StatsReply, before: pb.StatsReply | None = None) -> str:
    """How the data loop took the calls, each way's share: since `before` when it took any since
    (and counted on: an executor restarted in between has counted anew), else since start; and how
    much of that time the loop was at work (a sharded executor's: its busiest rank's, merged())."""
    def taken(old) -> dict[str, int]:
        return {k: v - old.get(k, 0) for k, v in now.call_paths.items() if v > old.get(k, 0)}

    ways = {}
    if before is not None and now.uptime_s > before.uptime_s and now.loop_busy_s >= before.loop_busy_s:
        ways = taken(before.call_paths)
    if not ways or not set(ways) - {LATE}:
        before, ways = None, taken({})
    late = ways.pop(LATE, 0)
    total = sum(ways.values())
    busy = now.loop_busy_s - (before.loop_busy_s if before is not None else 0.0)
    up = now.uptime_s - (before.uptime_s if before is not None else 0.0)
    shares = ", ".join(f"{k} {v / total:.0%}" + (f" ({min(late, v) / v:.0%} of them late)" if k == NATIVE else "")
                       for k, v in sorted(ways.items(), key=lambda kv: -kv[1]))
    return (f"calls taken{'' if before is not None else ' since start'}: {shares or 'none yet'} | data loop at work "
            f"{busy / max(up, 1e-9):.0%} of the time, {now.loop_rounds - (before.loop_rounds if before is not None else 0)} rounds")


def rank_urls(url: str, timeout_s: float = 5.0) -> list[str]:
    """The local:// address of every rank of the executor serving `url` (itself alone when it is not sharded)."""
    shards = request(url, pb.ControlRequest(catalog=pb.CatalogRequest()), timeout_s, what="catalog").catalog.shards
    found = [next((u for u in s.urls if urls.parse(u)[0] == "local"), "") for s in shards]
    return found if len(found) > 1 and all(found) else [url]


_LARGEST = frozenset({"tenants", "uptime_s", "hosted_adapters", "merge_switches", "merge_switch_ms", "loop_busy_s"})
"""StatsReply fields whose value over ranks is the largest rank's: every tenant and every hosted
adapter is on every rank (and each merge is made on each); and the data loop's time at work, so
that its share of the time is the busiest rank's. The other numbers are summed (each rank counts its
own units' calls)."""


def merged(replies: list[pb.StatsReply]) -> pb.StatsReply:
    """The totals of a sharded executor's ranks as one StatsReply: counts summed, each class's waits
    the slowest rank's (a quantile over ranks cannot be had from theirs), each tenant's row summed
    over the ranks by its process (its placements joined: same-gpu+peer-gpu; a remote tenant's rows,
    which name no process, each as it is)."""
    out = pb.StatsReply()
    for f in pb.StatsReply.DESCRIPTOR.fields:
        if f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED:  # (protobuf 6 dropped .label)
            continue
        values = [getattr(r, f.name) for r in replies]
        if f.type == f.TYPE_STRING:
            setattr(out, f.name, next((v for v in values if v), ""))
        elif f.cpp_type in _NUMBERS:
            setattr(out, f.name, max(values) if f.name in _LARGEST else sum(values))
    classes: dict[int, pb.ClassStats] = {}
    tenants: dict[int, pb.TenantStats] = {}  # by pid
    for r in replies:
        out.units.extend(r.units)
        for k, v in r.call_paths.items():
            out.call_paths[k] += v
        for c in r.classes:
            m = classes.get(c.latency)
            if m is None:
                m = classes[c.latency] = out.classes.add(latency=c.latency, batch_calls=[0] * len(c.batch_calls))
            for name in ("calls", "batches", "tokens", "refused"):
                setattr(m, name, getattr(m, name) + getattr(c, name))
            m.batch_calls.extend([0] * (len(c.batch_calls) - len(m.batch_calls)))
            for i, n in enumerate(c.batch_calls):
                m.batch_calls[i] += n
            m.wait_p50_us, m.wait_p99_us = max(m.wait_p50_us, c.wait_p50_us), max(m.wait_p99_us, c.wait_p99_us)
        for t in r.tenant_stats:
            m = tenants.get(t.pid) if t.pid else None
            if m is None:
                m = out.tenant_stats.add(tenant_id=t.tenant_id, name=t.name, pid=t.pid, placement=t.placement)
                if t.pid:
                    tenants[t.pid] = m
            elif t.placement not in m.placement.split("+"):
                m.placement += "+" + t.placement
            for name in ("calls", "tokens", "queued_calls", "mailbox_bytes", "refused"):
                setattr(m, name, getattr(m, name) + getattr(t, name))
    return out


def sharded_table(now: list[pb.StatsReply], before: list[pb.StatsReply] | None, seconds: float, where: list[str]) -> str:
    """A sharded executor's table: the totals over its ranks (merged), then each rank's own table
    (its units' calls, its queues, its GPU's memory; every tenant is attached to every rank)."""
    rated = before is not None and seconds > 0
    parts = [f"{len(now)} ranks, their totals (class waits: the slowest rank's)",
             table(merged(now), merged(before) if rated else None, seconds)]
    for i, (r, u) in enumerate(zip(now, where)):
        parts += [f"\n== rank {i} ({u})", table(r, before[i] if rated else None, seconds)]
    return "\n".join(parts)


def show(url: str, watch: float = 0.0) -> int:
    """`base-executor stats URL`: the table once (rates over one second), or every `watch` seconds;
    for a sharded executor, the totals over its ranks and each rank's table."""
    where = rank_urls(url)
    before, t0 = [fetch(u) for u in where], time.monotonic()
    period = watch or 1.0
    while True:
        time.sleep(period)
        now, t1 = [fetch(u) for u in where], time.monotonic()
        text = table(now[0], before[0], t1 - t0) if len(where) == 1 else sharded_table(now, before, t1 - t0, where)
        if not watch:
            print(text)
            return 0
        print("\033[2J\033[H" + time.strftime("%H:%M:%S ") + url + "\n" + text, flush=True)
        before, t0 = now, t1


def ranks_reader(own_rank: int, own, others: dict[int, str], timeout_s: float = 2.0):
    """read() for serve_metrics on one host's ranks of a sharded executor: [(rank, its StatsReply,
    whether it answered now)], this rank's from `own()`, the others' from their local:// addresses
    (`others`: rank -> address), asked at once. A rank that does not answer counts with its last
    answer (None before its first), so the totals, counters to Prometheus, never go down."""
    import concurrent.futures

    last: dict[int, pb.StatsReply] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(others)), thread_name_prefix="rank-stats")

    def read():
        asked = {rank: pool.submit(fetch, url, timeout_s) for rank, url in others.items()}
        found = [(own_rank, own(), True)]
        for rank, future in sorted(asked.items()):
            try:
                last[rank] = future.result()
                found.append((rank, last[rank], True))
            except Exception:  # (a rank that is gone or stuck: rank_up 0)
                found.append((rank, last.get(rank), False))
        return sorted(found, key=lambda f: f[0])

    return read


class StatsCollector:
    """A prometheus_client collector over read() -> [(rank, StatsReply or None, answered now)]: one
    executor's figures (a single rank), or the totals of a sharded executor's ranks (merged) with a
    few figures per rank beside them (symbiont_rank_*)."""

    def __init__(self, read):
        self.read = read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ranks = self.read()
        known = [s for _, s, _ in ranks if s is not None]
        s = known[0] if len(ranks) == 1 else merged(known)

        def counter(name, doc, value, labels=None, label_values=()):
            m = CounterMetricFamily(f"symbiont_{name}", doc, labels=labels)
            m.add_metric(list(label_values), value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(f"symbiont_{name}", doc)
            m.add_metric([], value)
            return m

        yield gauge("tenants", "attached tenants", s.tenants)
        yield counter("calls", "calls served", s.calls)
        yield counter("batches", "batches run", s.batches)
        yield counter("tokens", "tokens served", s.tokens)
        yield counter("flops", "model FLOPs served (2 per multiply-add)", s.flops)
        yield counter("errors", "calls that failed", s.errors)
        yield counter("refused", "calls answered RETRY_LATER", s.refused)
        yield gauge("queued_calls", "calls in the queues now", s.queued_calls)
        yield gauge("queued_tokens", "tokens in the queues now", s.queued_tokens)
        yield gauge("hosted_adapters", "LoRA adapters the executor holds", s.hosted_adapters)
        yield counter("adapter_calls", "calls that named a hosted adapter", s.adapter_calls)
        yield gauge("adapter_resident_bytes", "hosted adapters' weights on the device now", s.adapter_resident_bytes)
        yield counter("adapter_hits", "calls whose hosted adapter was on the device", s.adapter_hits)
        yield counter("adapter_misses", "calls whose hosted adapter was paged in for them", s.adapter_misses)
        yield counter("adapter_evictions", "hosted adapters paged out of the device", s.adapter_evictions)
        yield counter("merge_switches", "hosted adapters merged or unmerged (serve --merge auto)", s.merge_switches)
        yield gauge("merged_bytes", "the merged adapter's copies of its units", s.merged_bytes)
        yield counter("merged_tokens", "tokens of calls served by a merged adapter's copies", s.merged_tokens)
        yield gauge("mailbox_bytes", "tenant mailboxes not yet freed", s.mailbox_bytes)
        paths = CounterMetricFamily("symbiont_call_paths", "calls by how the data loop took them", labels=["path"])
        for k, v in sorted(s.call_paths.items()):
            if k != LATE:
                paths.add_metric([k], v)
        yield paths
        yield counter("native_late_calls", "native-lane calls whose input was in before the lane took them "
                      "(the tenant's GPU waited for the executor's host)", s.call_paths.get(LATE, 0))
        yield counter("loop_busy_seconds", "the data loop's time at work, not waiting to be woken", s.loop_busy_s)
        yield counter("loop_rounds", "the data loop's rounds", s.loop_rounds)
        yield gauge("gpu_allocated_bytes", "the executor's GPU memory, torch's allocator", s.gpu_allocated_bytes)
        yield gauge("host_private_bytes", "the executor's private host memory", s.rss_anon_bytes)
        batches = CounterMetricFamily("symbiont_class_batches", "batches by class and calls per batch",
                                      labels=["latency", "calls_per_batch"])
        wait = GaugeMetricFamily("symbiont_class_wait_us", "queue wait over a class's last 4096 queued calls (those taken at once, call_paths, never queue)",
                                 labels=["latency", "quantile"])
        calls = CounterMetricFamily("symbiont_class_calls", "calls by class", labels=["latency"])
        for c in s.classes:
            name = CLASS_NAMES.get(c.latency, str(c.latency))
            calls.add_metric([name], c.calls)
            for bucket, n in zip(BUCKETS, c.batch_calls):
                batches.add_metric([name, bucket], n)
            wait.add_metric([name, "0.5"], c.wait_p50_us)
            wait.add_metric([name, "0.99"], c.wait_p99_us)
        yield calls
        yield batches
        yield wait
        tenant_calls = CounterMetricFamily("symbiont_tenant_calls", "calls served per tenant", labels=["tenant", "name", "placement"])
        tenant_mb = GaugeMetricFamily("symbiont_tenant_mailbox_bytes", "mailbox per tenant", labels=["tenant", "name", "placement"])
        for t in s.tenant_stats:
            labels = [str(t.tenant_id), t.name, t.placement]
            tenant_calls.add_metric(labels, t.calls)
            tenant_mb.add_metric(labels, t.mailbox_bytes)
        yield tenant_calls
        yield tenant_mb
        if len(ranks) > 1:
            per_rank = {
                "up": GaugeMetricFamily("symbiont_rank_up", "1 when the rank answered this scrape", labels=["rank"]),
                "calls": CounterMetricFamily("symbiont_rank_calls", "calls a rank served", labels=["rank"]),
                "tokens": CounterMetricFamily("symbiont_rank_tokens", "tokens a rank served", labels=["rank"]),
                "queued_calls": GaugeMetricFamily("symbiont_rank_queued_calls", "calls in a rank's queues now", labels=["rank"]),
                "gpu_allocated_bytes": GaugeMetricFamily("symbiont_rank_gpu_allocated_bytes", "a rank's GPU memory, torch's allocator",
                                                         labels=["rank"]),
            }
            for rank, r, answered in ranks:
                per_rank["up"].add_metric([str(rank)], 1 if answered else 0)
                for name, m in per_rank.items():
                    if r is not None and name != "up":
                        m.add_metric([str(rank)], getattr(r, name))
            yield from per_rank.values()


def serve_metrics(port: int, read) -> None:
    """Starts the Prometheus endpoint on `port` (a daemon thread) with the figures of read() ->
    [(rank, StatsReply or None, answered now)] (ranks_reader; one executor: [(0, its StatsReply, True)])."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry
    except ImportError as e:
        raise SystemExit(f"--metrics-port needs the prometheus-client package (pip install prometheus-client): {e}") from None
    registry = CollectorRegistry()
    registry.register(StatsCollector(read))
    start_http_server(port, registry=registry)
