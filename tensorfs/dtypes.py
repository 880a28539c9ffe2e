"""The safetensors dtype table: every dtype name the format knows, its width, and its numpy dtype."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    """One safetensors dtype."""

    name: str
    """The name as it appears in a header, e.g. "BF16"."""
    bits: int
    """Bits per element; 4 and 6 are packed sub-byte types."""
    numpy: np.dtype | None
    """The little-endian numpy dtype (ml_dtypes for bf16/fp8); None for packed F4/F6."""

    @cached_property
    def numpy_name(self) -> str | None:
        """A string `np.dtype()` accepts (once ml_dtypes is imported), e.g. "<f4" or "bfloat16"."""
        if self.numpy is None:
            return None
        # ml_dtypes types have no meaningful typestr ("<V2"); their registered name round-trips.
        if self.numpy.type.__module__.startswith("ml_dtypes"):
            return self.numpy.name
        return self.numpy.str


def _dtype(name: str, bits: int, numpy: object) -> DType:
    return DType(name, bits, None if numpy is None else np.dtype(numpy))  # type: ignore[call-overload]


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _dtype("BOOL", 8, np.bool_),
        _dtype("F4", 4, None),
        _dtype("F6_E2M3", 6, None),
        _dtype("F6_E3M2", 6, None),
        _dtype("U8", 8, "<u1"),
        _dtype("I8", 8, "<i1"),
        _dtype("F8_E5M2", 8, ml_dtypes.float8_e5m2),
        _dtype("F8_E4M3", 8, ml_dtypes.float8_e4m3fn),
        _dtype("F8_E8M0", 8, ml_dtypes.float8_e8m0fnu),
        _dtype("F8_E4M3FNUZ", 8, ml_dtypes.float8_e4m3fnuz),
        _dtype("F8_E5M2FNUZ", 8, ml_dtypes.float8_e5m2fnuz),
        _dtype("I16", 16, "<i2"),
        _dtype("U16", 16, "<u2"),
        _dtype("F16", 16, "<f2"),
        _dtype("BF16", 16, ml_dtypes.bfloat16),
        _dtype("I32", 32, "<i4"),
        _dtype("U32", 32, "<u4"),
        _dtype("F32", 32, "<f4"),
        _dtype("C64", 64, "<c8"),
        _dtype("F64", 64, "<f8"),
        _dtype("I64", 64, "<i8"),
        _dtype("U64", 64, "<u8"),
    )
}
