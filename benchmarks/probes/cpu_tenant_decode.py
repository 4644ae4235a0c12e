"""A CPU tenant's greedy decode beside the unsplit model, for a py-spy profile of where a token's host
time goes (our client code against HF's): `tiny-llama`, LoRA on the attention projections, a CPU
executor on the same host, one thread.

    py-spy record -o prof.txt -f raw -r 500 -- python benchmarks/probes/cpu_tenant_decode.py 10
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tests.conftest import running_executor  # noqa: E402
from tests.models import lora_model  # noqa: E402


def rate(model, x, seconds: float) -> float:
    """Tokens a second of 64-token greedy runs over `seconds`."""
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model.generate(x, **kw)
        n += 64
    return n / (time.perf_counter() - t0)


def main() -> int:
    from symbiont import virtualize

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    torch.set_num_threads(1)
    x = torch.randint(0, 200, (1, 16))
    with running_executor("tiny-llama") as ex, torch.no_grad():
        tenant = virtualize(lora_model("tiny-llama"), ex.url).eval()
        tenant.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)  # (warm-up)
        mine = rate(tenant, x, seconds)
        plain = rate(lora_model("tiny-llama").eval(), x, 5.0)
    print(f"tenant {mine:.1f} tokens/s ({1e3 / mine:.2f} ms a token); unsplit {plain:.1f} ({1e3 / plain:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
