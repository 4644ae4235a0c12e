"""A tenant on cuda:0 whose input copy sits behind ~10 s of GPU sleep: alone on the executor, its
call is taken at once and the executor's GPU waits for the input. Prints "called" and lingers
(the test kills it while the executor's stream still waits)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from proto import executor_pb2 as pb  # noqa: E402
from tests.jobs import gpu_tenant_and_input  # noqa: E402

UNIT = "model.layers.0.mlp.down_proj"
conn, x = gpu_tenant_and_input(sys.argv[1], UNIT)
torch.cuda._sleep(20_000_000_000)
conn.transport.call(UNIT, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
print("called", flush=True)
time.sleep(120)
