"""tensorfs: serve the tensors of a safetensors model as files, or in-process as zero-copy numpy
arrays and torch tensors (a drop-in for safetensors.safe_open).

The public names are imported on first use: `import tensorfs` imports none of the modules behind
them, and each command of the CLI imports only what it uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import (
        IntegrityError,
        InvalidModelError,
        ModelClosedError,
        ModelNotFound,
        MountError,
        Problem,
        RefusedArgument,
        SliceError,
        TensorfsError,
        TensorNotFound,
    )
    from .formats import ShardHeader, TensorInfo
    from .loader import SafeOpen, TensorSlice, load_file, open_model, safe_open
    from .memmaps import memmap
    from .model import Model
    from .prefetch import Prefetch
    from .proof.signature import Signature, SignatureError
    from .selection import Selection
    from .sources.store import RemoteOptions

__version__ = "0.1.0"

_MODULE_OF = {
    "IntegrityError": "errors",
    "InvalidModelError": "errors",
    "ModelClosedError": "errors",
    "ModelNotFound": "errors",
    "MountError": "errors",
    "Problem": "errors",
    "RefusedArgument": "errors",
    "SliceError": "errors",
    "TensorfsError": "errors",
    "TensorNotFound": "errors",
    "ShardHeader": "formats",
    "TensorInfo": "formats",
    "SafeOpen": "loader",
    "TensorSlice": "loader",
    "load_file": "loader",
    "open_model": "loader",
    "safe_open": "loader",
    "memmap": "memmaps",
    "Model": "model",
    "Prefetch": "prefetch",
    "Signature": "proof.signature",
    "SignatureError": "proof.signature",
    "Selection": "selection",
    "RemoteOptions": "sources.store",
}
"""Each public name and the module of this package that defines it."""

__all__ = [
    "IntegrityError",
    "InvalidModelError",
    "Model",
    "ModelClosedError",
    "ModelNotFound",
    "MountError",
    "Prefetch",
    "Problem",
    "RefusedArgument",
    "RemoteOptions",
    "SafeOpen",
    "Selection",
    "ShardHeader",
    "Signature",
    "SignatureError",
    "SliceError",
    "TensorInfo",
    "TensorNotFound",
    "TensorSlice",
    "TensorfsError",
    "__version__",
    "load_file",
    "memmap",
    "open_model",
    "safe_open",
]


if not TYPE_CHECKING:  # type checkers see the imports above: a name mistyped is an error there, not Any

    def __getattr__(name: str) -> Any:
        """A public name, imported from its module the first time it is asked for, then kept here."""
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The public names with the rest of the module's, as if each were imported already."""
    return sorted({*globals(), *__all__})
