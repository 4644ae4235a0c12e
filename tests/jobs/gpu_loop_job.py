"""A tenant on the executor's GPU that calls forever (the test kills it mid-call)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from base_executor.models import build_builtin  # noqa: E402
from client import virtualize  # noqa: E402

model = virtualize(build_builtin("tiny-llama").cuda(), sys.argv[1])
x = torch.randint(1, 256, (4, 64), device="cuda")
print("ready", flush=True)
with torch.no_grad():
    while True:
        model(x)
