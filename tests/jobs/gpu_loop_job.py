"""A GPU tenant (argv[2], default cuda:0) that calls forever (the test kills it mid-call)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from symbiont.base_executor.models import build_builtin  # noqa: E402
from symbiont import virtualize  # noqa: E402

device = sys.argv[2] if len(sys.argv) > 2 else "cuda:0"
model = virtualize(build_builtin("tiny-llama").to(device), sys.argv[1])
x = torch.randint(1, 256, (4, 64), device=device)
print("ready", flush=True)
with torch.no_grad():
    while True:
        model(x)
