"""Executor addresses. `local://NAME` is the same-host transport; its control socket lives in
a per-user run directory so two users' executors of the same name never collide."""
from __future__ import annotations

import os
import re
import tempfile

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SCHEMES = ("local",)


def parse(url: str) -> tuple[str, str]:
    """('local', NAME) for 'local://NAME'; ValueError that shows a valid form otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"executor address {url!r} is not supported; use local://NAME (supported schemes: {SCHEMES})")
    if not _NAME.match(rest):
        raise ValueError(f"executor name {rest!r} in {url!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return scheme, rest


def run_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"symbiont-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def control_endpoint(name: str) -> str:
    return f"ipc://{os.path.join(run_dir(), name + '.sock')}"
