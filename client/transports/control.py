"""The tenant's control channel to a same-host executor: one ZeroMQ DEALER socket, one request
at a time, that gives up early when the executor's process is seen dead."""
from __future__ import annotations

import threading
import time

import zmq
from google.protobuf.message import DecodeError

from symbiont.client.errors import ExecutorUnavailableError, MalformedMessageError
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.procs import alive

SLICE_S = 0.2  # how often a wait for a reply looks whether the executor is alive


class ControlChannel:
    def __init__(self, url: str, endpoint: str):
        self.url = url
        self.endpoint = endpoint
        self.executor_pid = 0  # known once attached: a wait ends when this process is gone
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._lock = threading.Lock()  # the DEALER socket is not thread-safe

    def request(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        with self._lock:
            return self._request(request, timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _socket(self):
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        return self._sock

    def _request(self, request: pb.ControlRequest, timeout_s: float) -> pb.ControlReply:
        sock = self._socket()
        sock.send(request.SerializeToString())
        deadline = time.monotonic() + timeout_s
        answered = False
        pid = self.executor_pid
        while not answered and time.monotonic() < deadline:
            answered = bool(sock.poll(int(min(SLICE_S, max(deadline - time.monotonic(), 0)) * 1000)))
            if not answered and pid and not alive(pid):
                break
        if not answered:
            # a DEALER would deliver the late reply to the next request: start over with a new socket
            sock.close()
            self._sock = None
            if pid and not alive(pid):
                raise ExecutorUnavailableError(f"the executor at {self.url} (pid {pid}) is gone")
            raise ExecutorUnavailableError(
                f"no executor answered at {self.url} within {timeout_s:.0f} s (is `base-executor serve --listen {self.url}` running?)"
            )
        try:
            return pb.ControlReply.FromString(sock.recv())
        except DecodeError as e:
            raise MalformedMessageError(f"reply from {self.url} does not parse: {e}") from e
