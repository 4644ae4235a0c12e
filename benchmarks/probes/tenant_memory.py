"""What one fine-tuning tenant costs in GPU memory, piece by piece, against one plain HF + PEFT
process doing the same (S2's step: LoRA q,v, batch 2 x 512, AdamW, bf16). Issue 19, item 5.

    python benchmarks/probes/tenant_memory.py [--model llama-1b] [--tenants 2] [--out DIR] [-- serve flags]

One process at a time on an otherwise idle GPU (nvidia-smi's used memory is the whole GPU's):
the plain process alone; then an executor; then tenants one after another, each left running
(idle, its memory kept) while the next starts, so each tenant's increment shows what one more
tenant costs. Each child runs 3 steps and reports torch's figures: the peak allocated, reserved,
what the forward keeps for the backward (saved tensors by width, parameters left out) and what
was live between forward and backward. The parent adds nvidia-smi's used memory (so the CUDA
context, outside torch's allocator) and the executor's own counters (its allocator, mailboxes).
Prints a table and writes tenant_memory_<tag>.json into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository root
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

MIB = 2**20


def storage_ptr(t) -> int:
    """Where a tensor's storage starts; 0 for one with no data (a tenant's unit placeholders)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def child(a) -> int:
    """One tenant or plain process: build, 3 steps measured, report, then wait for a line on stdin."""
    import torch

    import fleet_worker

    a.role, a.index, a.seed = "finetune", a.index, 0
    model, conn = fleet_worker.build(a)
    model = fleet_worker.lora(model, fleet_worker.RANKS[a.index % len(fleet_worker.RANKS)], ["q_proj", "v_proj"])
    model.train()
    dev = torch.device(a.device)
    torch.cuda.synchronize(dev)
    built = torch.cuda.memory_allocated(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    params = {storage_ptr(p) for p in model.parameters()}
    hidden = model.config.hidden_size
    widths = {hidden: "hidden", model.config.vocab_size: "vocab",
              getattr(model.config, "intermediate_size", -1): "intermediate"}
    x = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device=dev)
    out = {}
    for step in range(3):
        saved: dict[int, tuple[int, str]] = {}

        def pack(t):
            ptr = storage_ptr(t)
            if ptr and t.device.type == "cuda" and ptr not in params and ptr not in saved:
                width = t.shape[-1] if t.dim() else 0
                saved[ptr] = (t.untyped_storage().nbytes(), widths.get(width, "other"))
            return t

        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=x, labels=x).loss
        torch.cuda.synchronize(dev)
        live_after_forward = torch.cuda.memory_allocated(dev) - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        torch.cuda.synchronize(dev)
        by_width: dict[str, int] = {}
        for nbytes, kind in saved.values():
            by_width[kind] = by_width.get(kind, 0) + nbytes
        out = {"built_allocated": built, "step_start_allocated": before, "live_after_forward": live_after_forward,
               "saved_for_backward": sum(by_width.values()), "saved_by_width": by_width,
               "peak_allocated": torch.cuda.max_memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
               "optimizer_and_adapters": sum(p.numel() * p.element_size() * 3 for p in model.parameters() if p.requires_grad)}
    print("measured " + json.dumps(out), flush=True)
    sys.stdin.readline()
    if conn is not None:
        conn.close()
    return 0


def gpu_used() -> int:
    time.sleep(1.0)
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=10).stdout
    return int(out.strip().splitlines()[0]) * MIB


def start_child(a, mode: str, index: int, url: str = "") -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, __file__, "--child", mode, "--model", a.model, "--device", a.device, "--batch", str(a.batch),
           "--seq", str(a.seq), "--index", str(index), "--url", url]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    for line in p.stdout:
        if line.startswith("measured "):
            return p, json.loads(line[len("measured "):])
    raise RuntimeError(f"{mode} child gave no figures (exit code {p.wait()})")


def end_child(p: subprocess.Popen) -> None:
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["plain", "symbiont"], default=None)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--url", default="")
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    p.add_argument("serve_flags", nargs="*", help="after --: flags for base-executor serve")
    a = p.parse_args()
    if a.child:
        a.mode = a.child
        return child(a)
    import fleet

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    idle = gpu_used()
    proc, figures = start_child(a, "plain", 0)
    rows.append({"who": "plain process", "gpu_used": gpu_used() - idle, **figures})
    end_child(proc)
    idle = gpu_used()
    executor, url = fleet.start_executor(a.model, a.device, *a.serve_flags, log_dir=out)
    tenants = []
    try:
        prev_used, prev_stats = gpu_used(), fleet.executor_stats(url)
        rows.append({"who": "executor", "gpu_used": prev_used - idle, "executor": prev_stats})
        for i in range(a.tenants):
            t, figures = start_child(a, "symbiont", i, url)
            tenants.append(t)
            used, stats = gpu_used(), fleet.executor_stats(url)
            grew = {k: int(stats.get(k, 0)) - int(prev_stats.get(k, 0)) for k in ("gpu_allocated_bytes", "gpu_reserved_bytes", "mailbox_bytes")}
            rows.append({"who": f"tenant {i + 1}", "gpu_used": used - prev_used, "executor_grew": grew, **figures})
            prev_used, prev_stats = used, stats
    finally:
        for t in tenants:
            end_child(t)
        fleet.stop(executor)
    print(f"\n{a.model}, LoRA q,v, batch {a.batch} x {a.seq}, bf16: MiB (nvidia-smi's GPU used is the whole GPU's increment)")
    print(f"{'who':<14} {'GPU used':>9} {'reserved':>9} {'context':>8} {'peak alloc':>10} {'live fwd':>9} {'saved':>7} "
          f"{'exec alloc':>10} {'exec rsv':>9} {'mailbox':>8}")
    for r in rows:
        g = r.get("executor_grew", {})
        ctx = r["gpu_used"] - r["reserved"] - g.get("gpu_reserved_bytes", 0) - g.get("mailbox_bytes", 0) if "reserved" in r else None
        cells = [r["gpu_used"], r.get("reserved"), ctx, r.get("peak_allocated"), r.get("live_after_forward"),
                 r.get("saved_for_backward"), g.get("gpu_allocated_bytes"), g.get("gpu_reserved_bytes"), g.get("mailbox_bytes")]
        print(f"{r['who']:<14} " + " ".join(f"{'' if c is None else f'{c / MIB:.0f}':>{w}}"
                                             for c, w in zip(cells, (9, 9, 8, 10, 9, 7, 10, 9, 8))))
    for r in rows:
        if "saved_by_width" in r:
            print(f"{r['who']}: saved for backward by width (MiB): " +
                  ", ".join(f"{k} {v / MIB:.0f}" for k, v in sorted(r["saved_by_width"].items())))
    path = out / f"tenant_memory_{a.model}_{a.tag}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
