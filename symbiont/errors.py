"""The typed errors a tenant sees, under their public name (defined in `symbiont.client.errors`)."""
from symbiont.client.errors import (  # noqa: F401
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
