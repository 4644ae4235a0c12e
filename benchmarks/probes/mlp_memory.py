"""Memory of whole-MLP calls: the executor's transient memory for one MLP unit's BACKWARD (the
recompute from the input, then the activation's backward op run directly, against the same
through autograd), and what an unsplit block keeps between its forward and its backward, which
a tenant with whole-MLP calls does not keep (it keeps the block's input only). bf16, one layer of
the model's shape, on a GPU.

    python benchmarks/probes/mlp_memory.py [--models llama-1b llama-8b] [--tokens 1024 2048]

Prints a table (MiB and intermediate widths per token) and writes mlp_memory.json to --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository root
sys.path.insert(0, str(REPO))


def peak_mib(fn) -> float:
    """Peak memory allocated while fn runs, above what was allocated before, MiB (its result included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def kept_mib(block, x: torch.Tensor) -> float:
    """Memory an unsplit block's forward keeps for its backward, MiB (its output excluded)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = block(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept / 2**20


def main() -> int:
    from transformers import AutoModelForCausalLM

    from symbiont.base_executor import runner
    from symbiont.base_executor.catalog import UnitTable
    from symbiont.base_executor.models import BUILTINS
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    rows = []
    for name in a.models:
        config = BUILTINS[name].config()
        config.num_hidden_layers, config.vocab_size = 1, 1024  # one MLP block is what is measured
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to("cuda", torch.bfloat16).eval()
        unit = UnitTable(model).get("model.layers.0.mlp")
        block = model.model.layers[0].mlp
        act_backward = unit.act_backward
        width = config.intermediate_size
        for tokens in a.tokens:
            xg = torch.randn(tokens, 2 * config.hidden_size, device="cuda", dtype=torch.bfloat16)
            unit.act_backward = act_backward
            direct = peak_mib(lambda: runner.run(unit, pb.BACKWARD, xg))
            unit.act_backward = None
            through_autograd = peak_mib(lambda: runner.run(unit, pb.BACKWARD, xg))
            x = xg[:, : config.hidden_size].clone().requires_grad_()
            with torch.enable_grad():
                kept = kept_mib(block, x)
            per_width = tokens * width * 2 / 2**20  # MiB of one bf16 intermediate-wide activation
            rows.append({"model": name, "tokens": tokens, "backward_direct_mib": direct, "backward_autograd_mib": through_autograd,
                         "unsplit_kept_mib": kept, "tenant_kept_mib": tokens * config.hidden_size * 2 / 2**20,
                         "intermediate_width_mib": per_width})
        model = block = unit = None  # (frees this model's weights before the next)
        torch.cuda.empty_cache()
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    (out_dir / "mlp_memory.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"\nWhole-MLP memory, bf16, {gpu}: MiB (in intermediate widths per token)")
    print(f"{'model':10s} {'tokens':>6s} {'executor backward, direct':>28s} {'through autograd':>20s} "
          f"{'unsplit block keeps':>22s} {'tenant keeps':>14s}")
    for r in rows:
        w = r["intermediate_width_mib"]
        print(f"{r['model']:10s} {r['tokens']:6d} {r['backward_direct_mib']:18.1f} ({r['backward_direct_mib'] / w:4.1f}) "
              f"{r['backward_autograd_mib']:12.1f} ({r['backward_autograd_mib'] / w:4.1f}) "
              f"{r['unsplit_kept_mib']:14.1f} ({r['unsplit_kept_mib'] / w:4.1f}) {r['tenant_kept_mib']:7.1f} ({r['tenant_kept_mib'] / w:4.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
