"""symbiont: one executor holds a base model's frozen layers; many tenants keep their adapters.

The public tenant API: `from symbiont import virtualize, connect`; errors in `symbiont.errors`
(also exported here). The executor is `symbiont.base_executor` (console script `base-executor`).

The repository keeps `client/`, `proto/` and `base_executor/` at its top; installed, they are
`symbiont.client`, `symbiont.proto` and `symbiont.base_executor` (pyproject's package_dir). In a
source checkout that is not installed (a copy on a GPU host, say), this package also looks in the
repository's root for them, so `import symbiont` works with the root on sys.path alone.
"""
from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "client").is_dir() and (_root / "client" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 - a package's __path__

_EXPORTS = (
    "Connection", "connect", "parameters_on_meta", "wait_for_executor", "virtualize", "served_weight_names", "VirtLayer", "RemoteWeight", "SymbiontError",
    "InvalidCallError", "UnknownUnitError", "ShapeMismatchError", "DTypeMismatchError", "ResourceExhaustedError", "RetryLaterError",
    "NotAttachedError", "MalformedMessageError", "ModelMismatchError", "ExecutorUnavailableError", "InternalError",
    "AuthenticationError",
)
__all__ = [*_EXPORTS, "errors"]


def __getattr__(name):
    # lazy, so the executor (symbiont.base_executor) never imports the tenant side
    if name in _EXPORTS:
        from symbiont import client

        return getattr(client, name)
    if name == "errors":
        from symbiont import errors

        return errors
    raise AttributeError(f"module 'symbiont' has no attribute {name!r}")
