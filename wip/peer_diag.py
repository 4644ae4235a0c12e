"""Other-GPU placement diagnosis (two GPUs): a tenant on cuda:1 against the unsplit model, with
and without graph replays. Run from the repository root: python3 wip/peer_diag.py [peer-copy]"""
import sys, torch
sys.path.insert(0, ".")
from base_executor.models import build_builtin
from client import connect, virtualize
from tests.conftest import running_executor
from tests.models import ids
torch.backends.cuda.matmul.allow_tf32 = False
planes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["peer-copy"]
for flags in ((), ("--graph-tokens", "0")):
    for plane in planes:
        try:
            with running_executor("tiny-llama", "--device", "cuda:0", *flags) as ex:
                dev = torch.device("cuda:1"); torch.cuda.set_device(dev)
                ref = build_builtin("tiny-llama").to(dev)
                conn = connect(ex.url) if plane == "peer-copy" else connect(ex.url, other_gpu=plane)
                virt = virtualize(build_builtin("tiny-llama").to(dev), conn)
                x = ids(2, 13).to(dev)
                kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
                with torch.no_grad():
                    a, b = ref(x[:1]).logits, virt(x[:1]).logits
                    c, d = ref(x).logits, virt(x).logits
                g1, g2 = ref.generate(x[:1], **kw), virt.generate(x[:1], **kw)
                print(flags, plane, "logits1", (a - b).abs().max().item(), "logits2", (c - d).abs().max().item(),
                      "gen equal", torch.equal(g1, g2), "stats", conn.stats().graph_replays, flush=True)
                conn.close()
        except Exception as e:
            print(flags, plane, "FAILED", type(e).__name__, str(e)[:300], flush=True)
