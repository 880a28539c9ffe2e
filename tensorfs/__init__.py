"""tensorfs: serve the tensors of a safetensors model as files, or as zero-copy numpy views."""

from .errors import InvalidModelError, ModelClosedError, MountError, Problem, TensorfsError
from .formats import ShardHeader, TensorInfo
from .model import Model, open_model
from .mounted import memmap
from .selection import Selection
from .sources.store import RemoteOptions

__version__ = "0.1.0"

__all__ = [
    "InvalidModelError",
    "Model",
    "ModelClosedError",
    "MountError",
    "Problem",
    "RemoteOptions",
    "Selection",
    "ShardHeader",
    "TensorInfo",
    "TensorfsError",
    "__version__",
    "memmap",
    "open_model",
]
