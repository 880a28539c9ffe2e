"""What the globals of a state dict's pickle mean to tensorfs's pickle machine (pickled.py): the
records it builds instead of what torch would (storages, tensors, a dict as its pairs), the few
functions torch.save's pickle calls, each as what it makes here, the one lookup every global named
passes (anything not allowed refused before anything is made of it), and the work budget every
reading of a pickle is charged to.
"""

from __future__ import annotations

import _compat_pickle
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .dtypes import DTYPES, DType

MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
MAX_INT = (1 << 63) - 1
WORK_PER_BYTE = 16
"""Items a pickle's reading may cost, a byte of it: what its calls copy, what the walks over what it
built visit, the characters of the names made (a state dict's cost a few a byte in all)."""
WORK_FLOOR = 1_000_000
"""Items any pickle may cost, however short."""
SHOWN_CHARACTERS = 120
"""The most of a string from a pickle that a message shows."""


class Refused(Exception):
    """What makes the pickle unreadable, in one line."""


class Budget:
    """The work reading one pickle may cost, in items (WORK_PER_BYTE a byte of it, WORK_FLOOR at
    least): each step that could be repeated on what a short pickle names again and again is charged
    here, and Refused once the budget is spent."""

    def __init__(self, length: int) -> None:
        self.limit = WORK_PER_BYTE * length + WORK_FLOOR
        self.spent = 0

    def charge(self, cost: int) -> None:
        self.spent += cost
        if self.spent > self.limit:
            raise Refused(f"costs more than {WORK_PER_BYTE} items a byte of it to read: not what torch.save writes")


@dataclass(frozen=True, slots=True)
class Storage:
    """A storage named by a persistent id: its record (data/KEY in the archive), and what it holds."""

    key: str
    dtype: DType | None
    """From its storage class; None for an UntypedStorage (bytes; a tensor's dtype says what they are)."""
    count: int
    """Elements of its dtype (bytes for an UntypedStorage)."""

    @property
    def nbytes(self) -> int:
        return self.count * (self.dtype.bits // 8 if self.dtype else 1)


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as torch rebuilds it: a view of `storage` from `offset` (elements), of `shape` and `stride`."""

    storage: Storage
    dtype: DType
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self) -> bool:
        """Whether its elements are in row-major order one after another (dimensions of 1 ignored, as torch does)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return self.numel == 0
            expected *= size
        return True


class Pairs(list[tuple[Any, Any]]):
    """A dict (or OrderedDict) as its pairs in order: nothing hashed of what a pickle chose."""


@dataclass(frozen=True, slots=True)
class _Global:
    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True, slots=True)
class _TorchDType:
    dtype: DType | None
    name: str


# torch's storage classes and dtypes by name, and the safetensors dtype of each (None: safetensors has none).
STORAGE_DTYPES: dict[str, str | None] = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "ComplexFloatStorage": "C64", "ComplexDoubleStorage": None,
    "QInt8Storage": None, "QUInt8Storage": None, "QInt32Storage": None, "QUInt4x2Storage": None,
    "QUInt2x4Storage": None,
}  # fmt: skip
TORCH_DTYPES: dict[str, str | None] = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "complex128": None, "complex32": None, "float4_e2m1fn_x2": None,
    "qint8": None, "quint8": None, "qint32": None, "quint4x2": None, "quint2x4": None,
}  # fmt: skip
UNSUPPORTED_REBUILDS = {
    "_rebuild_qtensor": "a quantized tensor",
    "_rebuild_sparse_tensor": "a sparse tensor",
    "_rebuild_sparse_csr": "a sparse tensor",
    "_rebuild_meta_tensor_no_storage": "a meta tensor (no data)",
    "_rebuild_nested_tensor": "a nested tensor",
    "_rebuild_wrapper_subclass": "a tensor subclass",
    "_rebuild_device_tensor_from_numpy": "a tensor saved from numpy",
    "_rebuild_xla_tensor": "an XLA tensor",
    "_rebuild_mtia_tensor": "an MTIA tensor",
}


def _dtype(name: str | None, what: str) -> DType:
    if name is None:
        raise Refused(f"{what}: safetensors has no such dtype, and tensorfs serves safetensors' dtypes")
    return DTYPES[name]


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise Refused(f"a tensor's {what} is not a tuple of at most {MAX_DIMS} integers")
    if not all(type(item) is int and 0 <= item <= MAX_INT for item in value):
        raise Refused(f"a tensor's {what} holds something other than integers from 0 to 2^63-1")
    return value


def _tensor(storage: Any, offset: Any, shape: Any, stride: Any, dtype: DType | None = None) -> Tensor:
    if not isinstance(storage, Storage):
        raise Refused("a tensor is rebuilt from something other than a storage")
    if type(offset) is not int or not 0 <= offset <= MAX_INT:
        raise Refused("a tensor's storage offset is not an integer from 0 to 2^63-1")
    shape, stride = _ints(shape, "size"), _ints(stride, "stride")
    if len(shape) != len(stride):
        raise Refused(f"a tensor's size has {len(shape)} dimensions and its stride {len(stride)}")
    dtype = dtype or storage.dtype or DTYPES["U8"]
    if storage.dtype is not None and storage.dtype is not dtype:
        raise Refused(f"a {dtype.name} tensor over a storage of {storage.dtype.name}")
    return Tensor(storage, dtype, offset, shape, stride)


def _rebuild_v1(storage: Any, offset: Any, shape: Any, stride: Any) -> Tensor:
    """torch._utils._rebuild_tensor(storage, storage_offset, size, stride)."""
    return _tensor(storage, offset, shape, stride)


def _rebuild_v2(
    storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any, _hooks: Any, metadata: Any = None
) -> Tensor:
    """torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks[, metadata])."""
    _as_torch_sets(requires_grad, metadata)
    return _tensor(storage, offset, shape, stride)


def _rebuild_v3(
    storage: Any,
    offset: Any,
    shape: Any,
    stride: Any,
    requires_grad: Any,
    _hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> Tensor:
    """torch._utils._rebuild_tensor_v3(..., requires_grad, hooks, dtype[, metadata]): an UntypedStorage's."""
    if not isinstance(dtype, _TorchDType):
        raise Refused("a tensor's dtype is not a torch dtype")
    _as_torch_sets(requires_grad, metadata)
    safetensors_name = dtype.dtype.name if dtype.dtype else None
    return _tensor(storage, offset, shape, stride, _dtype(safetensors_name, f"torch.{dtype.name}"))


def _as_torch_sets(requires_grad: Any, metadata: Any) -> None:
    """What torch refuses of a rebuilt tensor's requires_grad (a bool) and metadata (a dict, if any);
    and a conjugate or negative bit, which makes its values other than its bytes."""
    if type(requires_grad) is not bool:
        raise Refused("a tensor's requires_grad is not a bool")
    if not metadata:
        return
    if not isinstance(metadata, Pairs) or not all(type(key) is str and type(bit) is bool for key, bit in metadata):
        raise Refused("a tensor's metadata is not a dict of names and bools")
    if any(bit and key in ("conj", "neg") for key, bit in metadata):
        raise Refused(
            "a tensor saved as a lazy conjugate or negative view: its values are not its bytes; "
            "save tensor.resolve_conj().resolve_neg() instead"
        )


def _parameter(data: Any, requires_grad: Any = True, _hooks: Any = None) -> Tensor:
    """A Parameter is its tensor (requires_grad and hooks mean nothing to bytes, but torch wants a bool)."""
    if not isinstance(data, Tensor):
        raise Refused("a parameter is rebuilt from something other than a tensor")
    if type(requires_grad) is not bool:
        raise Refused("a parameter's requires_grad is not a bool")
    return data


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Tensor:
    """torch._utils._rebuild_parameter(data, requires_grad, backward_hooks)."""
    return _parameter(data, requires_grad, hooks)


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, _state: Any) -> Tensor:
    """torch._utils._rebuild_parameter_with_state(data, requires_grad, backward_hooks, state)."""
    return _parameter(data, requires_grad, hooks)


def _from_type(function: Any, new_type: Any, args: Any, _state: Any) -> tuple[Any, Any]:
    """torch._tensor._rebuild_from_type_v2(function, type, args, state): a Tensor or Parameter made by
    `function(*args)`; the call it makes, which call makes in turn (never by recursion: a pickle can
    wrap one in another 100,000 times)."""
    if not isinstance(new_type, _Global) or str(new_type) not in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        raise Refused(f"a tensor of type {what(new_type)} (only torch.Tensor and Parameter are read)")
    return function, args


def _ordered_dict(*args: Any) -> Pairs:
    if not args:
        return Pairs()
    if len(args) == 1 and isinstance(args[0], list | tuple) and all(_pair(item) for item in args[0]):
        return Pairs(args[0])
    raise Refused("an OrderedDict made of something other than pairs")


def _pair(item: Any) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """_codecs.encode(text, "latin1"): how protocol 2 pickles bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise Refused("_codecs.encode of something other than a string, to latin1 or utf-8")
    return text.encode(str(encoding))


def _device(value: Any = "cpu", *_: Any) -> str:
    """torch.device("cpu"), torch.device("cuda", 0): its type's name (a str of anything else could be
    the text of a structure of 2^60 leaves)."""
    if not isinstance(value, str):
        raise Refused("torch.device of something other than a string")
    return value


def _as_tuple(value: Any = ()) -> tuple[Any, ...]:
    if not isinstance(value, tuple | list):
        raise Refused("torch.Size of something other than a sequence")
    return tuple(value)


def _as_list(value: Any = ()) -> list[Any]:
    if not isinstance(value, tuple | list):
        raise Refused("a set of something other than a sequence")
    return list(value)


def _as_bytes(value: Any = b"", *_: Any) -> bytes:
    if not isinstance(value, bytes | str):
        raise Refused("a bytearray of something other than bytes")  # bytearray(10**12) would be a bomb
    return value.encode("latin1") if isinstance(value, str) else value


CALLABLE: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": _ordered_dict,
    "torch._utils._rebuild_tensor": _rebuild_v1,
    "torch._utils._rebuild_tensor_v2": _rebuild_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "torch.nn.parameter.Parameter": _parameter,
    "torch._tensor._rebuild_from_type_v2": _from_type,  # unwrapped by call
    "torch.Size": _as_tuple,
    "torch.device": _device,
    "_codecs.encode": _encode,
    "builtins.set": _as_list,
    "builtins.frozenset": _as_list,
    "builtins.bytearray": _as_bytes,
}
"""The globals a state dict's pickle calls (those torch.load(weights_only=True) accepts for one),
each as what it makes here, taking the arguments torch's function takes."""
NAMED_ONLY = {"torch.Tensor"}
"""Globals that may be named (as _rebuild_from_type_v2's type) but not called."""


def lookup(module: str, name: str) -> Any:
    """An allowed global as this machine has it: a storage class, a dtype, or a _Global of CALLABLE.
    Python 2's names (__builtin__.set: protocol 2 writes them) are Python 3's, as pickle has them."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    full = f"{module}.{name}"
    if module == "torch" and name in STORAGE_DTYPES:
        return _StorageClass(name, STORAGE_DTYPES[name])
    if full in ("torch.storage.UntypedStorage", "torch.UntypedStorage"):
        return _StorageClass(name, "")
    if module == "torch" and name in TORCH_DTYPES:
        found = TORCH_DTYPES[name]
        return _TorchDType(DTYPES[found] if found else None, name)
    if full in CALLABLE or full in NAMED_ONLY:
        return _Global(module, name)
    if module == "torch._utils" and name in UNSUPPORTED_REBUILDS:
        raise Refused(f"holds {UNSUPPORTED_REBUILDS[name]} ({full}), which tensorfs does not read")
    raise Refused(f"names the global {shown(full)}, which a state dict saved by torch.save never does: refused unrun")


@dataclass(frozen=True, slots=True)
class _StorageClass:
    name: str
    dtype_name: str | None
    """The safetensors dtype; "" for an UntypedStorage; None for one safetensors has no dtype for."""


_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


def call(function: Any, args: Any, budget: Budget) -> Any:
    """What calling `function` (a _Global) with `args` makes here; a _rebuild_from_type_v2 is the
    call it wraps, made in turn."""
    while True:
        if not isinstance(function, _Global) or str(function) not in CALLABLE:
            raise Refused(f"calls {what(function)}, which is not one of the functions a state dict's pickle calls")
        if not isinstance(args, tuple):
            raise Refused(f"calls {function} with arguments that are not a tuple")
        # What a call copies (a list made a tuple, a string encoded) is paid for: called again and
        # again on one long list, it would make a short pickle take hours.
        budget.charge(1 + sum(len(arg) for arg in args if isinstance(arg, str | bytes | list | tuple)))
        try:
            made = CALLABLE[str(function)](*args)
        except TypeError:
            raise Refused(f"calls {function} with {len(args)} arguments") from None
        if str(function) != _FROM_TYPE:
            return made
        function, args = made


def what(value: Any) -> str:
    """What a message says of a value a pickle made: a global's name, else its type (never its text:
    a tuple of 2^60 leaves has a text of their length)."""
    return str(value) if isinstance(value, _Global) else f"a {type(value).__name__}"


def shown(text: str) -> str:
    """A string of a pickle as a message quotes it: its first SHOWN_CHARACTERS (a pickle's strings
    may take 64 MiB)."""
    return repr(text) if len(text) <= SHOWN_CHARACTERS else f"{text[:SHOWN_CHARACTERS]!r}... ({len(text):,} characters)"


def storage(pid: Any) -> Storage:
    """The storage a persistent id names: ('storage', storage class, key, location, count)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise Refused("a persistent id that is not a storage's ('storage', class, key, location, count)")
    _, kind, key, location, count = pid
    if not isinstance(kind, _StorageClass):
        raise Refused(f"a storage of {what(kind)}, which is not a torch storage class")
    if not isinstance(key, str) or not isinstance(location, str) or type(count) is not int or count < 0:
        said = shown(key) if isinstance(key, str) else what(key)
        raise Refused(f"storage {said}: its key, location or size is not what torch writes")
    if kind.dtype_name is None:
        raise Refused(f"storage {shown(key)}: a torch.{kind.name} (safetensors has no such dtype)")
    return Storage(key, DTYPES[kind.dtype_name] if kind.dtype_name else None, count)
