"""The safetensors dtype table: every dtype name the format knows, its width, and its numpy dtype.

numpy (and ml_dtypes, for bf16 and fp8) is imported only when a numpy dtype is asked for: mounting
and serving never need it, and it costs a fifth of a second and ten MiB to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class DType:
    """One safetensors dtype."""

    name: str
    """The name as it appears in a header, e.g. "BF16"."""
    bits: int
    """Bits per element; 4 and 6 are packed sub-byte types."""
    numpy_name: str | None
    """A string `np.dtype()` accepts once ml_dtypes is imported ("<f4", "bfloat16"); None for F4/F6."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _by_name, (self.name,)  # unpickled, a dtype is the table's own object again

    @cached_property
    def numpy(self) -> np.dtype | None:
        """The little-endian numpy dtype (ml_dtypes for bf16/fp8); None for packed F4/F6."""
        if self.numpy_name is None:
            return None
        import ml_dtypes  # noqa: F401  (registers bfloat16 and the fp8 names with numpy)
        import numpy as np

        return np.dtype(self.numpy_name)


def _by_name(name: str) -> DType:
    return DTYPES[name]


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "|b1"),
        DType("F4", 4, None),
        DType("F6_E2M3", 6, None),
        DType("F6_E3M2", 6, None),
        DType("U8", 8, "|u1"),
        DType("I8", 8, "|i1"),
        DType("F8_E5M2", 8, "float8_e5m2"),
        DType("F8_E4M3", 8, "float8_e4m3fn"),
        DType("F8_E8M0", 8, "float8_e8m0fnu"),
        DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
        DType("I16", 16, "<i2"),
        DType("U16", 16, "<u2"),
        DType("F16", 16, "<f2"),
        DType("BF16", 16, "bfloat16"),
        DType("I32", 32, "<i4"),
        DType("U32", 32, "<u4"),
        DType("F32", 32, "<f4"),
        DType("C64", 64, "<c8"),
        DType("F64", 64, "<f8"),
        DType("I64", 64, "<i8"),
        DType("U64", 64, "<u8"),
    )
}
