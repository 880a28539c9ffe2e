"""Tensors as a framework holds them: numpy arrays and torch tensors made over a shard's bytes,
without a copy. torch is optional (the `torch` extra), imported only when a torch tensor is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import RefusedArgument, TensorfsError, printable
from .dtypes import DType

FRAMEWORKS = {"np": "np", "numpy": "np", "pt": "pt", "torch": "pt"}
"""The framework names safetensors takes that tensorfs serves, and which of the two each is."""

TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F4": "float4_e2m1fn_x2",
}
"""safetensors dtype -> the torch dtype's name. F4 is torch's two-in-a-byte type, its last dimension
halved (as safetensors gives it); F6 comes as its raw uint8 bytes."""


def framework_of(framework: str) -> str:
    """'np' or 'pt' for a framework name safetensors takes; RefusedArgument for any other."""
    found = FRAMEWORKS.get(framework)
    if found is None:
        raise RefusedArgument(
            f"framework {printable(str(framework))} is invalid: tensorfs serves 'pt' (torch) or 'np' (numpy)"
        )
    return found


def check_device(framework: str, device: Any) -> None:
    """A device the framework has, as safetensors checks it before opening: numpy arrays live on the
    CPU alone; torch takes what `torch.device` takes ("cuda:1", 1 for "cuda:1", "mps", ...)."""
    if str(device) == "cpu":
        return
    if framework == "np":
        raise RefusedArgument(
            f"Device {printable(str(device))} is not supported for framework numpy: numpy arrays live on the CPU; "
            "use framework='pt' for another device"
        )
    torch = import_torch()
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RefusedArgument(f"device {printable(str(device))} is invalid: torch does not know it: {reason}") from None


def make_tensor(buffer: memoryview, dtype: DType, shape: Sequence[int], framework: str, device: Any = "cpu") -> Any:
    """A numpy array (`framework` 'np') or a torch tensor ('pt') over `buffer`, the tensor's bytes, no
    copy: it shares them, and is writable exactly when `buffer` is. A torch tensor for another device
    than the CPU is a copy there."""
    if framework == "np":
        return _numpy(buffer, dtype, shape)
    return _torch(buffer, dtype, shape, device)


def given_as_bytes(dtype: DType, shape: Sequence[int], framework: str) -> bool:
    """Whether a tensor of `dtype` and `shape` comes in `framework` as its raw bytes (uint8, one
    dimension), the framework having no such dtype: numpy's packed F4/F6 and block-quantized types;
    torch's F6, blocks, and F4 but in pairs of values (an even last dimension)."""
    if framework == "np":
        return dtype.numpy is None
    return dtype.packed and not (dtype.name == "F4" and shape and shape[-1] % 2 == 0)


def _numpy(buffer: memoryview, dtype: DType, shape: Sequence[int]) -> Any:
    import numpy as np

    if given_as_bytes(dtype, shape, "np"):
        return np.frombuffer(buffer, dtype=np.uint8)
    return np.frombuffer(buffer, dtype=dtype.numpy).reshape(shape)


def _torch(buffer: memoryview, dtype: DType, shape: Sequence[int], device: Any) -> Any:
    torch = import_torch()
    name = TORCH_DTYPES.get(dtype.name)
    if given_as_bytes(dtype, shape, "pt"):  # not into whole elements (F6, blocks): as numpy gets them
        name, shape = "uint8", (len(buffer),)
    elif dtype.name == "F4":
        shape = (*shape[:-1], shape[-1] // 2)  # two values in each element
    kind = getattr(torch, name or "uint8")
    if len(buffer) == 0:
        tensor = torch.empty(tuple(shape), dtype=kind)  # frombuffer refuses an empty buffer
    else:
        tensor = torch.frombuffer(buffer, dtype=kind).reshape(tuple(shape))
    return tensor if str(device) == "cpu" else tensor.to(device)


def import_torch() -> Any:
    """torch, or a TensorfsError saying how to have it."""
    try:
        import torch
    except ImportError:
        raise TensorfsError("torch is not installed: pip install 'tensorfs[torch]' (or torch)") from None
    return torch
