"""A tenant on cuda:0 whose GPU waits for a result when its executor is killed. argv[1]: the
executor's URL. Prints "called", then waits for a line on stdin (the test kills the executor
meanwhile) and prints, one per line, "synchronized" if torch.cuda.synchronize() returned within
30 s, then the name of the exception its next call raised."""
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from symbiont.proto import executor_pb2 as pb  # noqa: E402
from tests.jobs import gpu_tenant_and_input  # noqa: E402

UNIT = "model.layers.0.mlp.down_proj"
conn, x = gpu_tenant_and_input(sys.argv[1], UNIT)


def call():
    return conn.transport.call(UNIT, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)


call()
conn.transport.confirm()
torch.cuda.synchronize()
torch.cuda._sleep(4_000_000_000)  # ~2 s: the executor is gone before our input is in
call()
print("called", flush=True)
sys.stdin.readline()


def sync():
    try:
        torch.cuda.synchronize()
    except Exception:  # (reading the dead executor's memory may fault our context)
        pass


th = threading.Thread(target=sync, daemon=True)
th.start()
th.join(30)
print("synchronized" if not th.is_alive() else "hung", flush=True)
try:
    call()
    print("no error", flush=True)
except Exception as e:
    print(type(e).__name__, flush=True)
os._exit(0)
