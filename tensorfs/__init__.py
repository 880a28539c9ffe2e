"""tensorfs: serve the tensors of a safetensors model as files, or in-process as zero-copy numpy
arrays and torch tensors (a drop-in for safetensors.safe_open)."""

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
