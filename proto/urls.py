"""Executor addresses. `local://NAME` is the same-host transport; its control socket lives in
a per-user run directory so two users' executors of the same name never collide.
`grpc://HOST:PORT` is the gRPC service for tenants on other hosts (HOST a name, an IPv4 address
or a bracketed IPv6 one)."""
from __future__ import annotations

import os
import re
import tempfile

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):([0-9]{1,5})$")
SCHEMES = ("local", "grpc")


def parse(url: str) -> tuple[str, str]:
    """('local', NAME) for 'local://NAME', ('grpc', 'HOST:PORT') for 'grpc://HOST:PORT';
    ValueError that shows a valid form otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"executor address {url!r} is not supported; use local://NAME or grpc://HOST:PORT (supported schemes: {SCHEMES})"
        )
    if scheme == "grpc":
        m = _HOST_PORT.match(rest)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"gRPC address {rest!r} in {url!r} must be HOST:PORT with a port from 1 to 65535")
        return scheme, rest
    if not _NAME.match(rest):
        raise ValueError(f"executor name {rest!r} in {url!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return scheme, rest


def run_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"symbiont-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def control_endpoint(name: str) -> str:
    return f"ipc://{os.path.join(run_dir(), name + '.sock')}"


def provider_token_path(name: str) -> str:
    """Where a local executor keeps the provider's token (mode 0600 in the user's 0700 run
    directory): whoever can read it may manage the executor's shared adapters."""
    return os.path.join(run_dir(), name + ".provider")
