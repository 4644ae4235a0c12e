"""Test fixtures: a real `base-executor serve` process per model, started by the tests."""
from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

if not torch.cuda.is_available():  # (before any test module imports Triton, as peft and torch._dynamo do)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's kernels run in its CPU interpreter (tests/test_atmm.py)

from symbiont import wait_for_executor  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_counter = itertools.count()


class Executor:
    """A running `base-executor serve` process; `url` is its address, `log()` its output so far."""

    def __init__(self, model: str, *flags: str):
        self.model = model
        self.url = f"local://test-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), self.url.split("//")[1] + ".log")
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", model, "--listen", self.url, *flags]
        if os.environ.get("SYMBIONT_TEST_LOG_LEVEL"):  # (say DEBUG, to read what an executor did: log_path)
            cmd += ["--log-level", os.environ["SYMBIONT_TEST_LOG_LEVEL"]]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_for_executor(self.url, 180, self.proc)
        except Exception as e:
            self.proc.kill()
            raise RuntimeError(f"executor did not come up ({e}):\n{self.log()}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_executor(model: str = "tiny-llama", *flags: str):
    ex = Executor(model, *flags)
    try:
        yield ex
    finally:
        rc = ex.stop()
        assert rc == 0, f"executor exited with {rc}:\n{ex.log()}"


_shared: dict[tuple[str, ...], Executor] = {}


@pytest.fixture(scope="session")
def executor_for():
    """executor_for(model, *flags) -> a session-wide executor of that built-in model served with
    those flags (started once)."""

    def get(model: str, *flags: str) -> Executor:
        ex = _shared.get((model, *flags))
        if ex is None or not ex.alive():
            ex = _shared[(model, *flags)] = Executor(model, *flags)
        return ex

    yield get
    for ex in _shared.values():
        rc = ex.stop()
        assert rc == 0, f"executor {ex.model} exited with {rc}:\n{ex.log()}"


@pytest.fixture
def executor(executor_for):
    """The session's tiny-llama executor."""
    return executor_for("tiny-llama")


@pytest.fixture
def unit_calls_executor(executor_for):
    """The session's tiny-llama executor without layer spans (a decoding layer makes its q/k/v,
    o_proj and MLP calls, as while training): for tests of those calls."""
    return executor_for("tiny-llama", "--no-layer-spans")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
