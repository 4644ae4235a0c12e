"""symbiont's tenant library: split a Hugging Face model so its frozen layers run in a base executor."""
from symbiont.client.connection import Connection, connect, parameters_on_meta, wait_for_executor
from symbiont.client.errors import (
    AuthenticationError,
    DTypeMismatchError,
    ExecutorUnavailableError,
    InternalError,
    InvalidCallError,
    MalformedMessageError,
    ModelMismatchError,
    NotAttachedError,
    OverBudgetError,
    ResourceExhaustedError,
    RetryLaterError,
    ShapeMismatchError,
    SymbiontError,
    UnknownUnitError,
)
from symbiont.client.shim import RemoteWeight, VirtLayer
from symbiont.client.virtualize import served_weight_names, virtualize

__all__ = [
    "Connection", "connect", "parameters_on_meta", "wait_for_executor", "virtualize", "served_weight_names", "VirtLayer", "RemoteWeight", "SymbiontError", "InvalidCallError",
    "UnknownUnitError", "ShapeMismatchError", "DTypeMismatchError", "ResourceExhaustedError", "RetryLaterError", "NotAttachedError",
    "MalformedMessageError", "ModelMismatchError", "ExecutorUnavailableError", "InternalError",
    "AuthenticationError", "OverBudgetError",
]
