"""What a causal LM's loss adds to a process's peak memory, and takes in time, over the logits it is
given: transformers' ForCausalLMLoss against the tenant's chunked loss (client/loss.py) and, on a
GPU, its fused loss (client/fused_loss.py), forward and backward, each in a fresh process (peak
resident memory on the CPU; on a GPU the allocator's peak and the median time of 10 after a first).

    python3 benchmarks/probes/loss_memory.py                       # S2's step: 2 x 512 tokens, llama's 128,256 vocabulary
    python3 benchmarks/probes/loss_memory.py --device cuda
"""
import argparse
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def one(mode: str, batch: int, seq: int, vocab: int, device: str) -> dict:
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from symbiont.client.loss import causal_lm_loss, fused_causal_lm_loss

    fn = {"transformers": ForCausalLMLoss, "chunked": causal_lm_loss, "fused": fused_causal_lm_loss}[mode]
    torch.manual_seed(0)
    logits = torch.randn(batch, seq, vocab, device=device, dtype=torch.bfloat16).mul_(4).requires_grad_(True)  # (no float32 temporary)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    cuda = device.startswith("cuda")
    times = []
    if cuda:  # (a first pass: Triton compiles its kernels; then ten timed)
        for _ in range(11):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(logits, labels, vocab).backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    t0 = time.perf_counter()
    loss = fn(logits, labels, vocab)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    took = statistics.median(times[1:]) if cuda else time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    return {"loss": mode, "peak_added_mib": round((peak - base) / 2**20, 1), "seconds": round(took, 3), "value": loss.item()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.batch, a.seq, a.vocab, a.device)))
        return
    logits_mib = a.batch * a.seq * a.vocab * 2 / 2**20
    print(f"logits {a.batch} x {a.seq} x {a.vocab} bfloat16 on {a.device}: {logits_mib:.0f} MiB; the loss's peak over them:")
    modes = ("transformers", "chunked", "fused") if a.device.startswith("cuda") else ("transformers", "chunked")
    for mode in modes * 2:
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--batch", str(a.batch), "--seq", str(a.seq),
                              "--vocab", str(a.vocab), "--device", a.device], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
