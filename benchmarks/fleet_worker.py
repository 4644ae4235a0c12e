"""One tenant of a many-tenant benchmark (S2-S5, S10): a plain HF + PEFT process, a symbiont tenant,
or one rank of an FSDP job.

    python benchmarks/fleet_worker.py --mode plain|symbiont|fsdp --role finetune|infer|infer-mixed ...

It builds its model (plain: the built-in config with random weights made on the device; symbiont:
`connect(url).model(device=...)`, no checkpoint), wraps it in LoRA, warms up, prints `ready`, waits
for `go` on stdin, then works until `--seconds` have passed and prints one JSON line:

- finetune: LoRA steps of `--batch` x `--seq` random tokens with AdamW; the end time of every step.
- infer: greedy `generate` of `--new-tokens` after a `--prompt`-token prompt at batch 1, again and
  again; the time of every generated token (a logits processor sees each step). `--compile MODE`:
  generate with a static KV cache and its forward compiled by torch.compile in that mode ("default":
  fused kernels; "reduce-overhead": CUDA graphs too, which a tenant's unit calls stay out of).
- infer-mixed: one process generating for `--adapters` tenants at once, each row its own adapter
  (PEFT mixed-adapter batching): the baseline of S3 beside N processes.

`--mode fsdp` (finetune only; S10's baseline, Symbiosis 4.2.2): this process is rank `--fsdp-rank`
of an FSDP job of `--fsdp-world` ranks (one per GPU; rendezvous at 127.0.0.1:`--fsdp-port`; gloo on
CPUs). The job trains one LoRA adapter: every decoder layer and the root are `fully_shard`ed (the
frozen base and the adapter sharded over the ranks, gathered layer by layer), each rank steps on its
own batch (data parallel); its tokens per step are its own, so the fleet's sum is the job's rate.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANKS = (8, 16, 32, 64)


class StepClock:
    """A logits processor that notes when each generated token's step ends (generate syncs the
    host on every token for its stopping check, so the host time is the GPU's too)."""

    def __init__(self, tick=None):
        self.times: list[float] = []
        self.tick = tick

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if self.tick is not None:
            self.tick(input_ids.shape[0])
        return scores


def build(a):
    from transformers import AutoModelForCausalLM

    device = torch.device(a.device)
    if a.mode in ("plain", "fsdp"):
        from symbiont.base_executor.models import BUILTINS

        config = BUILTINS[a.model].config()
        config._attn_implementation = "sdpa"
        torch.manual_seed(a.seed)
        if a.mode == "fsdp":  # parameters on the meta device: made, sharded, on the GPUs (fsdp_job)
            from symbiont import parameters_on_meta

            with parameters_on_meta():
                return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype)), None
        with device:  # random weights made on the device (their values do not change speed)
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype)), None
    from symbiont import connect

    conn = connect(a.url, name=f"{a.role}-{a.index}", spin_us=a.spin_us)  # (calls under no_grad go in the inference class)
    if a.wait_replies:  # (same GPU: the host waits for each reply; nothing of ours waits on the GPU)
        conn.transport.return_early = False
    return conn.model(device=device, attn_implementation="sdpa", lm_loss=a.lm_loss, step_graphs=_step_graphs(a)), conn


def lora(model, rank: int, targets: list[str], name: str = "default", into=None):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    if into is not None:
        into.add_adapter(name, config)
        return into
    return get_peft_model(model, config, adapter_name=name)


def fsdp_job(a, model):
    """Joins the FSDP job's process group and shards the LoRA-wrapped model (its parameters on the
    meta device) over its ranks; each rank then makes only its shards, with random values (they do
    not change speed), so a model larger than one GPU trains too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = "cuda" in a.device
    if cuda:
        torch.cuda.set_device(a.device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{a.fsdp_port}",
                            rank=a.fsdp_rank, world_size=a.fsdp_world)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (a.fsdp_world,))
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}  # (rotary frequencies: real)
    model.to_empty(device=a.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return model


def finetune(a, model, deadline_of, tick=lambda units: None) -> dict:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(a.seed + a.fsdp_rank)  # (an FSDP job's ranks: batches of their own)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(a.device) for _ in range(4)]

    forward = torch.compile(model, mode=a.compile_train) if a.compile_train else model  # (traced at the warm-up steps)

    def step(i):
        x = batches[i % len(batches)]
        forward(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize() if "cuda" in a.device else None
    start, deadline = deadline_of()
    ends = []
    i = 0
    while True:
        step(i)
        i += 1
        if "cuda" in a.device:
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        tick(1)
        if a.mode == "fsdp":  # (the job's ranks stop at the same step: a collective waits for every rank)
            import torch.distributed as dist

            done = torch.tensor([float(ends[-1] >= deadline)], device=a.device)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
        elif ends[-1] >= deadline:
            break
    return {"start": start, "ends": ends, "tokens_per_step": a.batch * a.seq}


def _steps_of(model):
    """The model's StepGraphs (client/step_graphs.py: installed on the model's root, under PEFT's wrapper)."""
    return model.get_base_model().forward if hasattr(model, "get_base_model") else model.forward


def _step_graphs(a):
    return "compiled" if a.step_graphs and a.compiled_steps else a.step_graphs


def infer(a, model, deadline_of, rows: int = 1, adapter_names=None, tick=None) -> dict:
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (rows, a.prompt), generator=g).to(a.device)
    kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
    if a.compile:
        from transformers import CompileConfig

        kw.update(cache_implementation="static", compile_config=CompileConfig(mode=a.compile))
    elif a.step_graphs or a.static_cache:  # (eager, as generate's own compiling is off)
        kw.update(cache_implementation="static", disable_compile=True)
    if adapter_names is not None:
        kw["adapter_names"] = adapter_names

    def one(tick=None):
        clock = StepClock(tick)
        with torch.no_grad():
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), logits_processor=[clock], **kw)
        return clock.times

    for _ in range(a.warmup):
        one()
    start, deadline = deadline_of()
    runs = []
    while True:
        t0 = time.perf_counter()
        times = one(tick)
        runs.append([t0, *times])
        if times[-1] >= deadline:
            break
    return {"start": start, "runs": runs, "rows": rows}


def prepare(a):
    """This tenant's or process's model as its role needs it (LoRA, hosted, FSDP, train or eval),
    its connection (None for a plain process) and infer-mixed's adapter names."""
    model, conn = build(a)
    targets = a.targets.split(",")
    names = None
    if a.role == "infer-mixed":
        names = [f"a{i}" for i in range(a.adapters)]
        model = lora(model, RANKS[0], targets, names[0])
        for i, n in enumerate(names[1:], start=1):
            lora(model, RANKS[i % len(RANKS)], targets, n, into=model)
    elif a.s9_adapter >= 0 and a.shared:
        del model  # the provider's adapter: the executor computes it
        model = conn.model(device=torch.device(a.device), attn_implementation="sdpa", adapter=f"s9-{a.s9_adapter}",
                           lm_loss=a.lm_loss, step_graphs=_step_graphs(a))
    elif a.s9_adapter >= 0:
        import s9_adapters

        weights = s9_adapters.adapter_weights(model.config, a.s9_adapter, targets=targets)
        model = lora(model, s9_adapters.rank_of(a.s9_adapter), targets)
        s9_adapters.load_into(model, weights)
    else:
        model = lora(model, RANKS[a.index % len(RANKS)], targets)
    if a.mode == "fsdp":
        if a.role != "finetune":
            raise SystemExit("--mode fsdp trains: --role finetune")
        model = fsdp_job(a, model)
    if a.hosted:  # the executor computes the adapter: the tenant's model holds none
        name = f"{a.role}-{a.index}"
        conn.host_adapter(name, model, device=a.device)
        del model
        model = conn.model(device=torch.device(a.device), attn_implementation="sdpa", adapter=name, lm_loss=a.lm_loss,
                           step_graphs=_step_graphs(a))
    if a.role == "finetune":
        model.train()
        if a.checkpointing:  # (each layer's activations recomputed in backward: a tenant's forward calls twice)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.eval()
    if a.step_graphs and a.gemm_linears:
        _steps_of(model).small_linears = False
    if a.step_graphs and a.compiled_prefill:
        _steps_of(model).compiled_prefill = True
    if a.step_graphs:  # (how each call's handover goes: client/transports/graph_words.py; set before the first capture)
        from symbiont.client.transports import graph_words

        graph_words.FUSED_HANDOVER, graph_words.SPIN_WARPS = a.fused_handover, a.spin_warps
        graph_words.SPIN_NAP_NS = a.spin_nap_ns
    return model, conn, names


def wait_for_go(a) -> tuple[float, float, float]:
    """After warm-up: says ready, waits for go; the shared start and the deadline (perf_counter),
    and the start as the parent sent it (wall clock)."""
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    assert line and line[0] == "go", line
    start = float(line[1])  # the parent's perf_counter is not ours: it sends the wall clock
    now_wall, now = time.time(), time.perf_counter()
    start_local = now - (now_wall - start)
    return start_local, start_local + a.seconds, start


def settle(*_) -> None:
    """--settle-forward: after a forward, this thread waits for its stream's work with the
    interpreter's lock released (Stream.synchronize), so generate's read of the next token (a
    pageable copy, which holds up the launches of the process's other threads while it waits: a
    CUDA driver lock) finds the GPU's work done."""
    torch.cuda.current_stream().synchronize()


def several(a) -> int:
    """--tenants N: N decoding tenants in this process, each its own connection, adapter (ranks by
    index, from --index on) and thread, with one ready/go for all; one result line each. More
    tenants than MPS takes processes (48 a GPU) run so, at the price of sharing one interpreter's lock."""
    import copy
    import threading

    adapters = [int(k) for k in a.s9_adapters.split(",")] if a.s9_adapters else None  # (checked in main)
    tenants = []
    for j in range(a.tenants):
        mine = copy.copy(a)
        mine.index, mine.tenants = a.index + j, 1
        if adapters is not None:
            mine.s9_adapter = adapters[j]
        model, conn, _ = prepare(mine)
        if a.settle_forward and "cuda" in a.device:
            model.register_forward_hook(settle)
        tenants.append((mine, model, conn))
    if "cuda" in a.device:  # (the adapters were made on the default stream; each tenant runs on a stream of its own)
        torch.cuda.synchronize(a.device)
    window = {}
    ready = threading.Barrier(len(tenants), action=lambda: window.update(w=wait_for_go(a)))  # (after every warm-up)

    def deadline_of():
        ready.wait()
        return window["w"][:2]

    outs: list = [None] * len(tenants)

    def run(j):
        mine, model, _ = tenants[j]
        try:  # (each on a stream of its own: on the process's one default stream the tenants' work would queue in one line)
            with torch.cuda.stream(torch.cuda.Stream(a.device)) if "cuda" in a.device else contextlib.nullcontext():
                outs[j] = infer(mine, model, deadline_of)
        except BaseException as e:  # (the others must not wait for this one at the barrier)
            outs[j] = e
            ready.abort()

    threads = [threading.Thread(target=run, args=(j,), name=f"tenant-{t[0].index}") for j, t in enumerate(tenants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in outs if isinstance(o, BaseException)]
    if errors:  # (the first that is not another's broken barrier)
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    for (mine, _, conn), out in zip(tenants, outs):
        if "cuda" in a.device:
            out["max_allocated"] = torch.cuda.max_memory_allocated(a.device)  # (the process's: every tenant's)
        out.update(role=a.role, mode=a.mode, index=mine.index)
        print("result " + json.dumps(out), flush=True)
        conn.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["plain", "symbiont", "fsdp"], required=True)
    p.add_argument("--role", choices=["finetune", "infer", "infer-mixed"], required=True)
    p.add_argument("--url", default="")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--index", type=int, default=0, help="this tenant's number: picks its rank (8/16/32/64 cycling)")
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=1, help="infer-mixed: how many adapters (rows) one process serves")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile-train", default="", choices=["", "default", "max-autotune-no-cudagraphs"],
                   help="finetune: the model's forward (and so its backward) compiled by torch.compile in this mode")
    p.add_argument("--compile", default="", choices=["", "default", "reduce-overhead"],
                   help="infer: a static KV cache and generate's forward compiled in this torch.compile mode (none: eager)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tenants", type=int, default=1, help="symbiont infer: this many tenants in this process, each "
                   "its own connection, adapter and thread (indexes from --index on)")
    p.add_argument("--dtype", default="bfloat16", help="plain and fsdp: the model's dtype")
    p.add_argument("--fsdp-rank", type=int, default=0)
    p.add_argument("--fsdp-world", type=int, default=1)
    p.add_argument("--fsdp-port", type=int, default=29511)
    p.add_argument("--hosted", action="store_true", help="symbiont infer: host the adapter in the executor (issue 21)")
    p.add_argument("--s9-adapter", type=int, default=-1, help="S9: the tenant's LoRA is registered adapter K "
                   "(benchmarks/s9_adapters.py: on --targets, its rank and weights), held privately unless --shared")
    p.add_argument("--s9-adapters", default="", help="S9 with --tenants N: each tenant's registered adapter, "
                   "comma-separated (as --s9-adapter, one per tenant)")
    p.add_argument("--shared", action="store_true", help="S9, symbiont: name the provider's registered adapter s9-K "
                   "(the executor computes it; the tenant holds none)")
    p.add_argument("--profile", default="", help="record this process's GPU work over --profile-window into this file")
    p.add_argument("--profile-window", default="0.4,0.6", help="its start and end, as shares of --seconds")
    p.add_argument("--checkpointing", action="store_true", help="finetune: gradient checkpointing (HF's), to fit "
                   "more jobs at the cost of a second forward")
    p.add_argument("--mps-priority", default="", help="this process's CUDA_MPS_CLIENT_PRIORITY (0 normal, 1 below "
                   "normal: its kernels' blocks go after other clients')")
    p.add_argument("--mps-threads", default="", help="this process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the share of "
                   "the GPU's SMs its kernels may use)")
    p.add_argument("--wait-replies", action="store_true", help="symbiont on the executor's GPU: each call waits for its reply "
                   "on the host (by default it returns at once and our GPU waits for the result)")
    p.add_argument("--settle-forward", action="store_true", help="symbiont --tenants N on a GPU: each tenant's "
                   "thread waits for its stream after every forward, the interpreter's lock released (settle())")
    p.add_argument("--spin-us", type=int, default=None, help="symbiont: how long a call spins on its reply before "
                   "sleeping (connect(spin_us=); default: by placement)")
    p.add_argument("--step-graphs", action="store_true", help="symbiont infer on the executor's GPU: decoding steps "
                   "replayed as CUDA graphs with their calls as step programs (a static cache; client/step_graphs.py)")
    p.add_argument("--compiled-steps", action="store_true", help="with --step-graphs: the steps captured from the "
                   "forward compiled by torch.compile (step_graphs='compiled')")
    p.add_argument("--fused-handover", action="store_true", help="with --step-graphs: each call of a step hands "
                   "over with two kernels (graph_words.FUSED_HANDOVER) instead of four (S3 at a quarter of the pace, session 51)")
    p.add_argument("--gemm-linears", action="store_true", help="with --compiled-steps: the tenant's LoRA linears stay "
                   "cuBLAS GEMMs (StepGraphs.small_linears = False) instead of reductions inductor fuses")
    p.add_argument("--no-cudnn-attention", action="store_true", help="SDPA never picks cuDNN's kernel "
                   "(torch.backends.cuda.enable_cudnn_sdp(False)): a decoding step's attention by another "
                   "backend (session 51: cuDNN's took 28 us a layer and ~3 layout kernels beside it)")
    p.add_argument("--compiled-prefill", action="store_true", help="with --compiled-steps: the prefill runs through "
                   "the compiled forward too (StepGraphs.compiled_prefill)")
    p.add_argument("--spin-warps", type=int, default=1, choices=[1, 2, 4, 8], help="symbiont with --step-graphs: "
                   "warps of each handover's wait (graph_words.SPIN_WARPS; the executor's: serve --spin-warps)")
    p.add_argument("--spin-nap-ns", type=int, default=0, help="symbiont with --step-graphs: nanoseconds each "
                   "handover's wait sleeps between its looks at the word (graph_words.SPIN_NAP_NS)")
    p.add_argument("--static-cache", action="store_true", help="infer: generate with a static KV cache, eagerly")
    p.add_argument("--lm-loss", default="fused", choices=["fused", "chunked", "transformers"],
                   help="symbiont: the causal-LM loss, conn.model(..., lm_loss=) (client/loss.py)")
    p.add_argument("--keep-full-masks", action="store_true", help="symbiont: decoding steps keep a full attention mask "
                   "(client/virtualize.py FULL_MASK_MODELS emptied before the model is built)")
    p.add_argument("--cuda-waits", default="auto", choices=["auto", "spin", "yield", "blocking"],
                   help="how this process's threads wait for its GPU (proto/cuda_ipc.set_host_waits): CUDA's "
                   "default spins a core while it waits, which 16 processes on 16 cores can make the executor wait for")
    a = p.parse_args()
    if a.mps_priority:  # (read when CUDA starts in this process, which is below)
        os.environ["CUDA_MPS_CLIENT_PRIORITY"] = a.mps_priority
    if a.mps_threads:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = a.mps_threads
    if a.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.cuda_waits != "auto" and a.device.startswith("cuda"):  # (before this process first uses its GPU)
        from symbiont.proto.cuda_ipc import set_host_waits

        set_host_waits(torch.device(a.device).index or 0, a.cuda_waits)

    if a.keep_full_masks:
        import symbiont.client.virtualize as virtualize_module

        virtualize_module.FULL_MASK_MODELS = ()
    if a.s9_adapters:  # (one per tenant; a lone tenant's is its --s9-adapter)
        adapters = a.s9_adapters.split(",")
        if len(adapters) != a.tenants:
            raise SystemExit(f"--s9-adapters names {len(adapters)} adapters for --tenants {a.tenants}")
        if a.tenants == 1:
            a.s9_adapter = int(adapters[0])
    if a.tenants > 1:
        if a.mode != "symbiont" or a.role != "infer" or a.profile:
            raise SystemExit("--tenants N: symbiont tenants that decode (--role infer), without --profile")
        return several(a)
    model, conn, names = prepare(a)
    profiler = []

    def deadline_of():
        start_local, deadline, start = wait_for_go(a)
        if a.profile:
            from fleet_timeline import WindowProfiler

            f0, f1 = (float(f) for f in a.profile_window.split(","))
            sync = (lambda: torch.cuda.synchronize(a.device)) if "cuda" in a.device else None
            profiler.append(WindowProfiler(a.profile, start + f0 * a.seconds, start + f1 * a.seconds, sync))
        return start_local, deadline

    def tick(units):
        if profiler:
            profiler[0].tick(units)

    if a.role == "finetune":
        out = finetune(a, model, deadline_of, tick)
    elif a.role == "infer":
        out = infer(a, model, deadline_of, tick=tick)
    else:
        out = infer(a, model, deadline_of, rows=a.adapters, adapter_names=names, tick=tick)
    if "cuda" in a.device:
        out["max_allocated"] = torch.cuda.max_memory_allocated(a.device)
        out["max_reserved"] = torch.cuda.max_memory_reserved(a.device)
    if a.step_graphs:  # (client/step_graphs.py: how its steps went)
        steps = _steps_of(model)
        out["step_graphs"] = {"captures": steps.captures, "replays": steps.replays, "failures": steps.failures[:2]}
    out.update(role=a.role, mode=a.mode, index=a.index)
    print("result " + json.dumps(out), flush=True)
    if conn is not None:
        conn.close()
    if a.mode == "fsdp":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
