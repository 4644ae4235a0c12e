"""The `base-executor` command: listing models, refusing bad input, logging, draining on SIGTERM."""
from __future__ import annotations

import subprocess
import sys
import threading

import torch

from symbiont.base_executor.models import build_builtin
from symbiont import connect, virtualize
from tests.conftest import REPO, running_executor


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "symbiont.base_executor.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_models_lists_builtins():
    out = cli("models").stdout
    for name in ("tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2", "tiny-gpt2", "tiny-phi3", "llama-1b", "llama-8b"):
        assert name in out
    assert "(default)" in out


def test_unknown_model_is_a_clear_error():
    r = cli("serve", "--model", "no-such-model", "--listen", "local://bad-model")
    assert r.returncode != 0
    assert "Built-ins:" in r.stderr and "tiny-llama" in r.stderr


def test_bad_listen_address_is_a_clear_error():
    r = cli("serve", "--model", "tiny-llama", "--listen", "tcp://1.2.3.4:5")
    assert r.returncode != 0 and "local://NAME" in r.stderr


def test_fused_gang_spans_are_refused_with_exact():
    r = cli("serve", "--model", "tiny-llama", "--listen", "local://exact-fused", "--exact", "--gang-spans", "fused")
    assert r.returncode != 0 and "--gang-spans fused" in r.stderr and "--exact" in r.stderr


def test_save_pretrained_directory_and_logs(tmp_path):
    build_builtin("tiny-qwen2").save_pretrained(tmp_path / "qwen")
    with running_executor(str(tmp_path / "qwen")) as ex:
        virt = virtualize(build_builtin("tiny-qwen2"), ex.url)
        x = torch.randint(1, 256, (1, 7))
        with torch.no_grad():
            assert torch.equal(virt(x).logits, build_builtin("tiny-qwen2")(x).logits)
        log = ex.log()
    assert "units" in log and "serving on " + ex.url in log and "attached" in log


def test_sigterm_drains_in_flight_calls_and_exits_cleanly():
    with running_executor("tiny-llama") as ex:
        model = virtualize(build_builtin("tiny-llama"), ex.url)
        x = torch.randint(1, 256, (2, 32))
        errors, done = [], []

        def work():
            try:
                for _ in range(1000):
                    with torch.no_grad():
                        model(x)
                    done.append(1)
            except Exception as e:  # after SIGTERM new calls are refused with a typed error
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        while not done:
            pass
        rc = ex.stop()
        t.join(30)
    assert rc == 0
    assert errors and type(errors[0]).__name__ in ("ExecutorUnavailableError", "NotAttachedError"), errors
    assert "draining" in ex.log() and "stopped" in ex.log()


def test_health_and_stats(executor):
    with connect(executor.url) as conn:
        h = conn.health()
        assert h.serving and h.model == "tiny-llama"
        s = conn.stats()
        assert s.rss_anon_bytes > 0
