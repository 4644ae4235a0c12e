"""connect(): a tenant's handle on an executor — its catalog, its skeleton, a model built from it."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import time
from typing import Callable

import torch
from torch import nn

from symbiont.client.errors import InvalidCallError
from symbiont.client.transport import Transport, open_transport
from symbiont.proto import codec, meta
from symbiont.proto import executor_pb2 as pb


class Connection:
    """One tenant identity at one executor. Attaches on first use; close() detaches."""

    def __deepcopy__(self, memo):
        return self  # (a copied model calls over the same connection: one tenant)

    def __init__(
        self, url: str, *, name: str | None = None, latency: int = pb.TRAINING, mailbox_mb: int = 0, spin_us: int | None = None,
        token: str | None = None, tls_dir: str | None = None, tenant: str | None = None, reconnect_s: float | None = None,
        latency_budget_ms: float | None = None, plane: str | None = None,
    ):
        self.url = url
        self.name = name or tenant or f"{os.path.basename(os.sys.argv[0]) or 'python'}:{os.getpid()}"
        self._options = dict(token=token, tls_dir=tls_dir, tenant=tenant, reconnect_s=reconnect_s, plane=plane)
        self._spin_us = spin_us
        if latency_budget_ms is not None and not 0 < latency_budget_ms < 4e6:
            raise ValueError(f"latency_budget_ms must be in (0, 4e6), got {latency_budget_ms}")
        self._budget_us = int(latency_budget_ms * 1000) if latency_budget_ms else 0
        self.transport: Transport = self._open(url)
        self._latency = latency
        self._mailbox_bytes = mailbox_mb << 20
        self._catalog: pb.CatalogReply | None = None
        self._skeleton: pb.SkeletonReply | None = None
        self._ranks: list[Transport] | None = None  # a sharded executor's ranks (this address's among them)

    def _open(self, url: str) -> Transport:
        t = open_transport(url, **self._options)
        if self._spin_us is not None:
            t.spin_us = self._spin_us
        t.budget_us = self._budget_us
        return t

    @property
    def transports(self) -> list[Transport]:
        """One transport per rank of the executor, index = rank: [self.transport] for an executor of
        one process; for a sharded one, each rank's address of the scheme this one has."""
        if self._ranks is None:
            shards = self.catalog().shards
            if not shards:
                self._ranks = [self.transport]
            else:
                scheme = self.url.partition("://")[0]
                ranks = []
                for r, shard in enumerate(shards):
                    url = next((u for u in shard.urls if u.startswith(scheme + "://")), None)
                    if url is None:
                        raise ValueError(f"rank {r} of the executor at {self.url} has no {scheme}:// address ({list(shard.urls)})")
                    ranks.append(self.transport if url == self.url else self._open(url))
                self._ranks = ranks
        return self._ranks

    def transport_for(self, unit: pb.UnitInfo) -> Transport:
        """The transport of the rank that serves `unit`."""
        return self.transports[unit.rank]

    def ensure_attached(self, device: torch.device | str = "cpu") -> None:
        """Attaches to every rank not yet attached; `device` is where this tenant's tensors live."""
        for t in self.transports:
            if not t.is_attached:
                t.attach(self.name, self._latency, self._mailbox_bytes, torch.device(device))

    def catalog(self) -> pb.CatalogReply:
        if self._catalog is None:
            self._catalog = self.transport.control("catalog", pb.CatalogRequest()).catalog
        return self._catalog

    def skeleton(self) -> pb.SkeletonReply:
        if self._skeleton is None:
            self._skeleton = self.transport.control("skeleton", pb.SkeletonRequest(), timeout_s=300).skeleton
        return self._skeleton

    def health(self) -> pb.HealthReply:
        return self.transport.control("health", pb.HealthRequest(), timeout_s=10).health

    def stats(self) -> pb.StatsReply:
        return self.transport.control("stats", pb.StatsRequest()).stats

    # ---- hosted adapters ------------------------------------------------------------

    def host_adapter(self, name: str, source, *, adapter_name: str = "default", device=None) -> pb.AdapterInfo:
        """Hands a LoRA adapter to the executor, which then computes it for the calls that name it
        (`virtualize(..., adapter=name)`, `model(..., adapter=name)`): `source` is a PEFT model
        (its adapter `adapter_name`) or a saved PEFT adapter directory. Only this tenant may use
        it; it is dropped when this tenant detaches. Hosted adapters are frozen (no gradients):
        train privately, then host. `device`: where this tenant's tensors will live, for the
        attach if it has not happened yet (as in model()). Plain LoRA only (no DoRA)."""
        from symbiont.proto.adapters import load_peft_dir, peft_weights

        if isinstance(source, (str, os.PathLike)):
            state, config = load_peft_dir(source)
        else:
            configs = getattr(source, "peft_config", None)
            if not configs or adapter_name not in configs:
                raise ValueError(f"{type(source).__name__} has no PEFT adapter {adapter_name!r}: pass a PEFT model or an adapter directory")
            state, config = source.state_dict(), configs[adapter_name].to_dict()
        weights = peft_weights(state, config, adapter_name)
        self.ensure_attached(device if device is not None else "cpu")
        if len(self.transports) == 1:
            return self.transport.control("host_adapter", pb.HostAdapterRequest(name=name, weights=weights)).host_adapter
        # a sharded executor: each rank hosts the adapter's share of the units it serves
        rank_of = {u.id: u.rank for u in self.catalog().units}
        shares: dict[int, list] = {}
        for w in weights:  # (a unit no rank serves goes to rank 0, which refuses it by name)
            shares.setdefault(rank_of.get(w.unit, 0), []).append(w)
        infos = []
        try:
            for rank, share in sorted(shares.items()):
                infos.append(self.transports[rank].control("host_adapter", pb.HostAdapterRequest(name=name, weights=share)).host_adapter)
        except Exception:
            for rank in sorted(shares)[: len(infos)]:  # (all or nothing)
                self.transports[rank].control("remove_adapter", pb.RemoveAdapterRequest(name=name))
            raise
        return _merged_info(infos)

    def adapters(self, name: str = "") -> list[pb.AdapterInfo]:
        """The hosted adapters this tenant may name (its own and the provider's), or the one called `name`."""
        return [_merged_info([info for _, info in infos]) for infos in self._adapters_by_rank(name).values()]

    def _adapters_by_rank(self, name: str = "") -> dict[tuple[str, bool], list[tuple[int, pb.AdapterInfo]]]:
        """Each hosted adapter's (rank, info) at every rank that holds a share of it, by (name, shared)."""
        self.ensure_attached()
        found: dict[tuple[str, bool], list[tuple[int, pb.AdapterInfo]]] = {}
        for rank, t in enumerate(self.transports):
            try:
                reply = t.control("adapters", pb.AdaptersRequest(name=name))
            except InvalidCallError:
                if len(self.transports) == 1:
                    raise
                continue  # (this rank holds none of it)
            for info in reply.adapters.adapters:
                found.setdefault((info.name, info.shared), []).append((rank, info))
        if name and not found:
            raise InvalidCallError(f"no adapter named {name!r} is hosted for this tenant")
        return found

    def adapter_ids(self, name: str) -> dict[int, int]:
        """The hosted adapter's id at each rank that holds a share of it (ids are per rank; a
        tenant's own adapter before the provider's of that name, as the executor resolves it)."""
        found = self._adapters_by_rank(name)
        return {rank: info.id for rank, info in found.get((name, False)) or found[(name, True)]}

    def remove_adapter(self, name: str) -> None:
        """Drops one of this tenant's hosted adapters (calls already sent still get it)."""
        holders = [rank for rank, _ in self._adapters_by_rank(name).get((name, False), [])] if len(self.transports) > 1 else []
        for rank in holders or [0]:  # (none of its own: rank 0 answers why, typed)
            self.transports[rank].control("remove_adapter", pb.RemoveAdapterRequest(name=name))

    def config(self):
        from transformers import AutoConfig

        d = json.loads(self.skeleton().config_json)
        return AutoConfig.for_model(d.pop("model_type"), **d)

    def model(
        self,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        build: Callable[[object], nn.Module] | None = None,
        attn_implementation: str | None = None,
        fuse: bool = True,
        whole_mlp: bool = True,
        adapter: str | None = None,
        lm_loss: str = "fused",
        step_graphs: bool | str = False,
    ) -> nn.Module:
        """The tenant's model built from the executor's skeleton alone, already virtualized and
        attached: no checkpoint on this side, and the units' weights are never materialised
        anywhere (their parameters are built on the meta device and become shims). The non-unit
        weights (norms, ...) and the buffers go to `device`, whose placement (CPU, the executor's
        GPU, a peer GPU) picks the data plane at attach.

        `dtype`: the served dtype (the default); the units compute in it, so another one raises.
        `build(config)` makes the model for a config (default: `AutoModelForCausalLM.from_config`);
        pass your own class's constructor to build that instead. Its module paths must be the
        served model's. `fuse`, `whole_mlp`, `adapter`, `lm_loss`, `step_graphs`: as for virtualize.
        """
        from safetensors.torch import load

        from symbiont.client.virtualize import virtualize
        from symbiont.proto.automodel import auto_model_class

        served = codec.torch_dtype(self.skeleton().dtype)
        if dtype is not None and dtype != served:
            raise ValueError(
                f"the executor serves {served}; a tenant model in {dtype} would feed its units the wrong dtype. "
                f"Pass dtype={served} or leave it out"
            )
        device = torch.device(device)
        config = self.config()
        if attn_implementation:
            config._attn_implementation = attn_implementation
        if build is None:
            build = lambda cfg: auto_model_class(cfg).from_config(cfg, dtype=served)  # noqa: E731
        with parameters_on_meta(), _default_dtype(served):
            model = build(config)
        for module in model.modules():  # computed buffers (rotary frequencies, ...) are real: move them
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
        # the non-unit weights first, one tensor at a time (what the device holds at most is them):
        # virtualize then sees the model as the tenant will use it
        state = load(self.skeleton().weights)
        model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
        virtualize(model, self, fuse=fuse, whole_mlp=whole_mlp, device=device, adapter=adapter, lm_loss=lm_loss,
                   step_graphs=step_graphs)
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if missing:
            raise RuntimeError(f"the executor's skeleton lacks weights for {missing[:5]}")
        model.eval()
        return model

    def tokenizer(self):
        """The served checkpoint's tokenizer; None when it has none."""
        files = self.skeleton().tokenizer_files
        if not files:
            return None
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as tmp:
            for fname, data in files.items():
                pathlib.Path(tmp, fname).write_bytes(data)
            return AutoTokenizer.from_pretrained(tmp)

    def close(self) -> None:
        for t in self._ranks or [self.transport]:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for_executor(url: str, timeout_s: float = 300.0, process=None) -> pb.HealthReply:
    """Waits until an executor answers at `url` and returns its health. `process` (a Popen of
    the executor, when the caller started it) makes a crash fail fast instead of timing out."""
    from symbiont.client.errors import ExecutorUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise ExecutorUnavailableError(f"the executor for {url} exited with code {process.returncode}")
        with Connection(url) as conn:
            try:
                return conn.transport.control("health", pb.HealthRequest(), timeout_s=1.0).health
            except ExecutorUnavailableError:
                if time.monotonic() > deadline:
                    raise ExecutorUnavailableError(f"no executor answered at {url} within {timeout_s:.0f} s") from None
        time.sleep(0.2)


def connect(url: str = "local://symbiont", **kwargs) -> Connection:
    """A new tenant identity at the executor serving `url`: 'local://NAME' on this host, or
    'grpc://HOST:PORT' on another. For gRPC with mutual TLS pass tls_dir= (a folder holding the
    provider's ca.pem and your NAME.pem, NAME.key, NAME.token) and tenant=NAME; token= gives the
    credential directly (an --insecure executor that asks for one); reconnect_s (default 60; 0:
    never) is how long a gRPC call waits for a restarted executor; plane="nccl" sends a gRPC call's
    tensors by NCCL (gloo to a CPU executor) instead of in the stream ("auto", the default: for a
    tenant on a GPU other than the executor's; "stream": never). latency_budget_ms: a call the
    executor expects to wait longer than this is refused at once (OverBudgetError), never queued.
    Other keywords: name, latency, mailbox_mb, spin_us."""
    return Connection(url, **kwargs)


def parameters_on_meta():
    """Builds modules with parameters on the meta device (no memory) but real buffers, so
    computed buffers such as rotary frequencies stay correct. A model built under it can be
    virtualized (its units never had weights), then take its non-unit weights with
    `load_state_dict(state, strict=False, assign=True)`; `Connection.model` does all of it."""
    return meta.parameters_on_meta()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Modules built inside make floating tensors in `dtype` (a user's `build` that takes no dtype)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _merged_info(infos: list[pb.AdapterInfo]) -> pb.AdapterInfo:
    """One adapter's info over the ranks that hold its shares (its id: the first rank's; ids are
    per rank, Connection.adapter_ids)."""
    if len(infos) == 1:
        return infos[0]
    merged = pb.AdapterInfo(name=infos[0].name, id=infos[0].id, shared=infos[0].shared)
    for info in infos:
        merged.units.extend(info.units)
        merged.ranks.extend(info.ranks)
        merged.bytes += info.bytes
    return merged
