"""A sharded executor: one logical executor over several processes, one per GPU (or per share of
a CPU), joined by torch.distributed (gloo between CPU processes and for control; NCCL between
GPUs for tensor parallelism).

Layer placement: whole layers go to ranks, contiguous in model order, balanced by the memory and
the FLOPs of their units. Every rank loads the checkpoint, computes the same placement (it is a
pure function of the unit table and the world size), keeps its own units and serves them on its
own address; every rank's catalog lists all units with their rank and all ranks' addresses, so a
tenant names any one address, attaches to every rank and sends each call to its unit's rank on
the plane that fits where the tenant sits (client/connection.py).

`base-executor serve --devices cuda:0,cuda:1` starts the ranks beyond the first itself, on this
host; `torchrun --nnodes N --nproc-per-node G -m symbiont.base_executor.cli serve --devices ...`
starts them across hosts (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from its
environment), each rank on `--devices[LOCAL_RANK]`. When one rank dies the others stop, so every
tenant gets a typed error (ExecutorUnavailableError) instead of a hang.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from symbiont.base_executor.catalog import EMBEDDING, UnitTable

log = logging.getLogger("base_executor")

PLACEMENTS = ("layers", "tensor")
URL_BYTES = 1024  # a rank's addresses, space-separated, utf-8, zero-padded, as exchanged between the ranks
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")  # a module path up to its first numeric part: model.layers.3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Where this process sits in a sharded executor."""

    devices: tuple[str, ...]  # the devices of one host's ranks, index = local rank
    placement: str = "layers"  # how units are spread over the ranks (PLACEMENTS)
    rank: int  # this process's rank, 0 .. world - 1
    world: int  # the number of ranks, over all hosts
    local_rank: int  # this process's index among its host's ranks
    launched: bool  # True when rank 0 of this host started the others (not torchrun)

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement {self.placement!r}: one of {PLACEMENTS}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} must lie in [0, world {self.world})")
        if not 0 <= self.local_rank < len(self.devices):
            raise ValueError(f"local rank {self.local_rank} has no device in --devices {','.join(self.devices)} "
                             f"({len(self.devices)} listed): list one device per rank of this host")

    @property
    def device(self) -> str:
        return self.devices[self.local_rank]


def shard_config(devices: str | None, placement: str) -> ShardConfig | None:
    """The sharding asked for by --devices and the environment: None for one process (one device
    and no torchrun). Under torchrun the world comes from its environment, else from --devices."""
    listed = tuple(d.strip() for d in (devices or "").split(",") if d.strip())
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        launched = os.environ.get("SYMBIONT_LAUNCHED") == "1"
        if world == 1:
            return None
        return ShardConfig(devices=listed or ("cpu",) * (local + 1), placement=placement, rank=rank, world=world,
                           local_rank=local, launched=launched)
    if len(listed) <= 1:
        return None
    return ShardConfig(devices=listed, placement=placement, rank=0, world=len(listed), local_rank=0, launched=True)


def layer_key(unit_id: str) -> str:
    """The layer a unit belongs to: its path up to the first numeric part (model.layers.3), or
    the unit itself outside numbered layers (embeddings, lm_head)."""
    m = _LAYER.match(unit_id)
    return m.group(1) if m else unit_id


def place_layers(table: UnitTable, world: int) -> dict[str, int]:
    """unit id -> rank: whole layers, contiguous in model order, so that the largest rank's share
    of the memory and of the FLOPs (weighted equally) is as small as it can be. A tied unit goes
    with its owner, a group or MLP unit with its members."""
    layers: dict[str, list] = {}  # in the table's (model) order
    for u in table.units.values():
        if not u.members:
            layers.setdefault(layer_key(u.tied_to or u.id), []).append(u)
    keys = list(layers)
    mem, flops = [], []
    for k in keys:
        seen, b, f = set(), 0, 0
        for u in layers[k]:
            for t in (u.weight, u.bias):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    b += t.numel() * t.element_size()
                    f += 0 if u.kind == EMBEDDING else 2 * t.numel()  # per token
        mem.append(b)
        flops.append(f)
    total_mem, total_flops = max(1, sum(mem)), max(1, sum(flops))
    cost = [0.5 * m / total_mem + 0.5 * f / total_flops for m, f in zip(mem, flops)]
    cuts = _contiguous_parts(cost, world)
    rank_of_layer = {k: r for r, (a, b) in enumerate(cuts) for k in keys[a:b]}
    rank: dict[str, int] = {}
    for k, units in layers.items():
        for u in units:
            rank[u.id] = rank_of_layer[k]
    for u in table.units.values():
        if u.members:
            first = u.members[0]
            while first.members:  # an MLP unit's first member is its gate/up group
                first = first.members[0]
            rank[u.id] = rank[first.id]
    return rank


def _contiguous_parts(cost: list[float], parts: int) -> list[tuple[int, int]]:
    """Splits cost[0:n] into `parts` contiguous ranges [a, b) minimising the largest range's sum
    (dynamic programming; every range non-empty while n >= parts)."""
    n = len(cost)
    if n < parts:
        raise ValueError(f"{n} layers cannot fill {parts} ranks: serve on at most {n} devices")
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[p][i]: first i layers in p ranges
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i]:
                    best[p][i], cut[p][i] = v, j
    ranges, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


# ---- processes ------------------------------------------------------------------------------


def launch_ranks(shard: ShardConfig, argv: list[str]) -> list[subprocess.Popen]:
    """Rank 0 of one host: starts ranks 1.. as `base-executor <argv>` with torchrun's variables
    (and a free port on this host for their rendezvous), their output beside ours."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(shard.world), RANK="0",
                      LOCAL_RANK="0", SYMBIONT_LAUNCHED="1")
    procs = []
    for r in range(1, shard.world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-m", "symbiont.base_executor.cli", *argv], env=env))
    return procs


def join_group(shard: ShardConfig, timeout_s: float = 900.0) -> None:
    """Joins the ranks' process group (gloo; a GPU rank adds NCCL for its collectives)."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if shard.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=shard.rank, world_size=shard.world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _gather_strings(mine: list[str], width: int, what: str) -> list[list[str]]:
    """Every rank's list of strings (lists of one length on every rank), index = rank: an
    all-gather over gloo of one zero-padded utf-8 row of `width` bytes per string (no pickle)."""
    import torch.distributed as dist

    buf = torch.zeros(len(mine), width, dtype=torch.uint8)
    for i, text in enumerate(mine):
        data = text.encode()
        if len(data) > width:
            raise ValueError(f"{what} {text!r} is longer than {width} bytes")
        if data:
            buf[i, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.zeros_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(every, buf)
    return [[bytes(row.tolist()).rstrip(b"\0").decode() for row in t] for t in every]


def exchange_urls(url: str) -> list[str]:
    """Every rank's address, index = rank."""
    return [urls[0] for urls in _gather_strings([url], URL_BYTES, "address")]


FINGERPRINT_BYTES = 96


def exchange_fingerprints(catalog, mine: dict[str, str]) -> None:
    """Sets every unit's fingerprint in `catalog` (the same units, in the same order, on every rank)
    from the rank that holds it: each rank gives those of its own units (`mine`)."""
    every = _gather_strings([mine.get(info.id, "") for info in catalog.units], FINGERPRINT_BYTES, "fingerprint")
    for i, info in enumerate(catalog.units):
        info.fingerprint = every[info.rank][i]


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rank_url(scheme: str, where: str, rank: int) -> str:
    """Rank `rank`'s address for rank 0's listen address (scheme, NAME or HOST:PORT): NAME.rR on
    this host; for gRPC the same host at PORT + rank."""
    if rank == 0:
        return f"{scheme}://{where}"
    if scheme == "local":
        return f"local://{where}.r{rank}"
    host, _, port = where.rpartition(":")
    return f"grpc://{host}:{int(port) + rank}"


def advertised_grpc(where: str, port: int) -> str:
    """The gRPC address tenants dial for a listener on `where` (HOST:PORT) bound to `port`: a
    wildcard host (0.0.0.0, [::]) becomes this host's name."""
    host = where.rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", "::"):
        host = socket.getfqdn()
    return f"grpc://{host}:{port}"


def watch(shard: ShardConfig, children: list[subprocess.Popen], stop) -> threading.Thread:
    """A thread that calls stop(why) when another rank dies: rank 0 of a host watches the ranks
    it started; they watch it. (Under torchrun, torchrun does.)"""
    parent = os.getppid()

    def run():
        while True:
            time.sleep(0.2)
            for r, p in enumerate(children, start=1):
                if p.poll() is not None:
                    stop(f"rank {r} (pid {p.pid}) exited with code {p.returncode}")
                    return
            if shard.launched and shard.rank != 0 and os.getppid() != parent:
                stop(f"rank 0 (pid {parent}) is gone")
                return

    t = threading.Thread(target=run, name="ranks", daemon=True)
    t.start()
    return t


def stop_ranks(children: list[subprocess.Popen], timeout_s: float = 30.0, grace_s: float = 0.0) -> list[int]:
    """Stops the ranks this one started (after grace_s for them to exit by themselves, SIGTERM,
    then SIGKILL after timeout_s); their exit codes."""
    deadline = time.monotonic() + grace_s
    for p in children:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for p in children:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in children:
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes
