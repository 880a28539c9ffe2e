"""The dtype tables: every dtype name safetensors knows (DTYPES), its width and its numpy dtype; and
GGML's types (GGML_TYPES, by their GGUF ids), the plain ones being safetensors' own dtypes, the
block-quantized ones dtypes of their own (their bytes are blocks: no numpy dtype). DTYPE_NAMED
holds both, by name.

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
    """A string `np.dtype()` accepts once ml_dtypes is imported ("<f4", "bfloat16"); None for F4/F6
    and block-quantized types."""
    block_size: int = 1
    """Elements per block: above 1 for GGML's block-quantized types (bits is then 0)."""
    type_size: int = 0
    """Bytes per block of a block-quantized type."""

    @property
    def packed(self) -> bool:
        """Whether an element is not a whole number of bytes (F4, F6, block-quantized types): its
        tensors are served as raw bytes."""
        return self.bits % 8 != 0 or self.block_size > 1

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _by_name, (self.name,)  # unpickled, a dtype is the table's own object again

    @cached_property
    def numpy(self) -> np.dtype | None:
        """The little-endian numpy dtype (ml_dtypes for bf16/fp8); None for packed F4/F6."""
        if self.numpy_name is None:
            return None
        # numpy's own dtypes need no ml_dtypes, whose import is slow (docs/performance.md)
        if not self.numpy_name.startswith(("<", "|")):
            import ml_dtypes  # noqa: F401  (registers bfloat16 and the fp8 names with numpy)
        import numpy as np

        return np.dtype(self.numpy_name)


def _by_name(name: str) -> DType:
    return DTYPE_NAMED[name]


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


def _blocks(name: str, block_size: int, type_size: int) -> DType:
    return DType(name, 0, None, block_size, type_size)


_QK_K = 256  # the super-block of the K-quants
GGML_TYPES: dict[int, DType] = {
    0: DTYPES["F32"],
    1: DTYPES["F16"],
    2: _blocks("Q4_0", 32, 2 + 16),
    3: _blocks("Q4_1", 32, 2 + 2 + 16),
    6: _blocks("Q5_0", 32, 2 + 4 + 16),
    7: _blocks("Q5_1", 32, 2 + 2 + 4 + 16),
    8: _blocks("Q8_0", 32, 2 + 32),
    9: _blocks("Q8_1", 32, 2 + 2 + 32),  # ggml's block_q8_1 (two halves, 32 bytes); the gguf package says 40
    10: _blocks("Q2_K", _QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    11: _blocks("Q3_K", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: _blocks("Q4_K", _QK_K, 2 + 2 + _QK_K // 2 + 12),
    13: _blocks("Q5_K", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 12),
    14: _blocks("Q6_K", _QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16),
    15: _blocks("Q8_K", _QK_K, 4 + _QK_K + _QK_K // 8),
    16: _blocks("IQ2_XXS", _QK_K, 2 + _QK_K // 4),
    17: _blocks("IQ2_XS", _QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    18: _blocks("IQ3_XXS", _QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    19: _blocks("IQ1_S", _QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    20: _blocks("IQ4_NL", 32, 2 + 16),
    21: _blocks("IQ3_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    22: _blocks("IQ2_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    23: _blocks("IQ4_XS", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 64),
    24: DTYPES["I8"],
    25: DTYPES["I16"],
    26: DTYPES["I32"],
    27: DTYPES["I64"],
    28: DTYPES["F64"],
    29: _blocks("IQ1_M", _QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    30: DTYPES["BF16"],
    34: _blocks("TQ1_0", _QK_K, 2 + 4 * 13),
    35: _blocks("TQ2_0", _QK_K, 2 + 64),
    39: _blocks("MXFP4", 32, 1 + 16),
    40: _blocks("NVFP4", 64, 4 + 32),
    41: _blocks("Q1_0", 128, 2 + 16),
}
"""GGML's types by their id in a GGUF file: every type the `gguf` package (0.19) knows, with its block
size (elements) and type size (bytes a block) as ggml has them (llama.cpp reads the files; the
package's Q8_1 is 40 bytes, ggml's 36). The ids missing were removed from ggml (Q4_2, Q4_3, the
Q4_0_4_4-style repackings): files holding them are refused."""

GGML_ID = {dtype.name: type_id for type_id, dtype in GGML_TYPES.items()}
"""A GGML type's id by its name."""

DTYPE_NAMED: dict[str, DType] = {**DTYPES, **{dtype.name: dtype for dtype in GGML_TYPES.values()}}
"""Every dtype by name: safetensors' and GGML's."""
