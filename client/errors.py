"""The exceptions a tenant sees. Each remote Status code maps to one class; the remote message is kept."""
from __future__ import annotations

from symbiont.proto import executor_pb2 as pb


class SymbiontError(RuntimeError):
    """Base class: a call or control request failed. `code` is the wire status code."""

    code = pb.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.remote_message = message


class InvalidCallError(SymbiontError, ValueError):
    code = pb.INVALID_ARGUMENT


class UnknownUnitError(InvalidCallError):
    code = pb.UNKNOWN_UNIT


class ShapeMismatchError(InvalidCallError):
    code = pb.SHAPE_MISMATCH


class DTypeMismatchError(InvalidCallError, TypeError):
    code = pb.DTYPE_MISMATCH


class ResourceExhaustedError(SymbiontError):
    code = pb.RESOURCE_EXHAUSTED


class NotAttachedError(SymbiontError):
    code = pb.NOT_ATTACHED


class MalformedMessageError(SymbiontError):
    code = pb.MALFORMED


class ModelMismatchError(SymbiontError, ValueError):
    code = pb.MODEL_MISMATCH


class ExecutorUnavailableError(SymbiontError, ConnectionError):
    code = pb.UNAVAILABLE


class InternalError(SymbiontError):
    code = pb.INTERNAL


class AuthenticationError(SymbiontError, PermissionError):
    """The executor refused this tenant's credential: no token, a token it does not know, or a
    client certificate issued to another tenant than the token's (gRPC)."""

    code = pb.UNAUTHENTICATED


class RetryLaterError(ResourceExhaustedError):
    """The executor refused the call for now (it is saturated, or this tenant is over its quota of
    queued calls or tokens); nothing was done. Send it again after `retry_after_s` seconds."""

    code = pb.RETRY_LATER
    retry_after_s: float = 0.0


class OverBudgetError(RetryLaterError):
    """The executor expected the call to wait longer than this connection's latency budget
    (connect(..., latency_budget_ms=)) and refused it at once; nothing was done."""

    code = pb.OVER_BUDGET


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidCallError,
        UnknownUnitError,
        ShapeMismatchError,
        DTypeMismatchError,
        ResourceExhaustedError,
        NotAttachedError,
        MalformedMessageError,
        ModelMismatchError,
        ExecutorUnavailableError,
        InternalError,
        RetryLaterError,
        OverBudgetError,
        AuthenticationError,
    )
}


def error_for_status(status: pb.Status, context: str = "") -> SymbiontError | None:
    """The exception of a non-OK status; None for OK."""
    if status.code == pb.OK:
        return None
    cls = _BY_CODE.get(status.code, InternalError)
    prefix = f"{context}: " if context else ""
    error = cls(f"{prefix}{pb.Code.Name(status.code) if status.code in pb.Code.values() else status.code}: {status.message}")
    if status.code in (pb.RETRY_LATER, pb.OVER_BUDGET):
        error.retry_after_s = status.retry_after_us * 1e-6
    return error


def raise_for_status(status: pb.Status, context: str = "") -> None:
    """Raises the exception of a non-OK status; returns for OK."""
    error = error_for_status(status, context)
    if error is not None:
        raise error
