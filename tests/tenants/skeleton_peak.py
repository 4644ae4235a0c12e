"""A tenant that builds its model from the executor's skeleton and reports its peak memory.

    python tests/tenants/skeleton_peak.py URL DEVICE

Prints one JSON line: the process's resident memory after its imports and its peak while building
the model (VmHWM, reset before), the non-unit weights' bytes, the mailbox's bytes, and on a GPU the peak
of torch's allocator while building (`torch.cuda.max_memory_allocated`).
"""
from __future__ import annotations

import json
import sys

import torch
import transformers  # noqa: F401 - imported before the baseline, like the model code it pulls in

from symbiont import RemoteWeight, connect


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's peak resident set size (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb * 1024


def main() -> None:
    url, device = sys.argv[1], torch.device(sys.argv[2])
    with connect(url) as conn:
        conn.skeleton()  # the skeleton's bytes arrive before the baseline: they are its size, not the model's
        import peft  # noqa: F401

        reset_peak_rss()
        before = peak_rss()  # now: what the process holds
        if device.type == "cuda":
            torch.cuda.init()
            torch.cuda.reset_peak_memory_stats(device)
        model = conn.model(device=device)
        after = peak_rss()
        non_unit = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, RemoteWeight))
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        out = {
            "rss_before": before, "rss_after": after, "non_unit_bytes": non_unit, "buffer_bytes": buffers,
            "mailbox_bytes": len(conn.transport._box.mem),
            "served_params": sum(u.in_features * u.out_features for u in conn.catalog().units if not u.members),
        }
        if device.type == "cuda":
            out["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        x = torch.randint(0, 1000, (1, 8), device=device)
        with torch.no_grad():
            out["logits_finite"] = bool(torch.isfinite(model(x).logits.float()).all())
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
