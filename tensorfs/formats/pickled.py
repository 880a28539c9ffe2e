"""A PyTorch checkpoint's data.pkl, read without running it: a small pickle machine that knows only
what `torch.save` writes for a state dict.

Python's own unpickler calls whatever a pickle names (its REDUCE is a function call), keeps a memo
as large as the biggest index a pickle gives, and builds dicts whose keys a pickle chooses (ints
that all hash alike make each insertion as slow as the dict is long): none of that fits a file
another user wrote. This machine walks the opcodes (pickletools decodes them, without building
anything), and builds only lists, tuples, strings, numbers and its own records: a dict is its list
of pairs, a global is a name looked up in ALLOWED (anything else is refused before anything is made
of it, naming the global), and "calling" an allowed global makes one of the records below. So
nothing of a pickle ever runs, memory stays in proportion to its length, and time too: every walk
over what it built is a loop (a structure nested 100,000 deep is no deeper a stack), each shared
structure is walked once (a key of 2^60 leaves made of 60 tuples, each twice the one below, costs
60 steps), and what the calls copy, the walks visit and the names made take is charged to one
Budget, in proportion to the pickle's length.
"""

from __future__ import annotations

import _compat_pickle
import io
import math
import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..dtypes import DTYPES, DType

MAX_MEMO_INDEX = 1 << 32
"""Memo indices a pickle may use (the protocol's own widest): the memo is a dict, never an array."""
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
    `function(*args)`; the call it makes, which _call makes in turn (never by recursion: a pickle can
    wrap one in another 100,000 times)."""
    if not isinstance(new_type, _Global) or str(new_type) not in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        raise Refused(f"a tensor of type {_what(new_type)} (only torch.Tensor and Parameter are read)")
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
    "torch._tensor._rebuild_from_type_v2": _from_type,  # unwrapped by _call
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


def _lookup(module: str, name: str) -> Any:
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
    raise Refused(f"names the global {_shown(full)}, which a state dict saved by torch.save never does: refused unrun")


@dataclass(frozen=True, slots=True)
class _StorageClass:
    name: str
    dtype_name: str | None
    """The safetensors dtype; "" for an UntypedStorage; None for one safetensors has no dtype for."""


_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


def _call(function: Any, args: Any, budget: Budget) -> Any:
    """What calling `function` (a _Global) with `args` makes here; a _rebuild_from_type_v2 is the
    call it wraps, made in turn."""
    while True:
        if not isinstance(function, _Global) or str(function) not in CALLABLE:
            raise Refused(f"calls {_what(function)}, which is not one of the functions a state dict's pickle calls")
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


def _what(value: Any) -> str:
    """What a message says of a value a pickle made: a global's name, else its type (never its text:
    a tuple of 2^60 leaves has a text of their length)."""
    return str(value) if isinstance(value, _Global) else f"a {type(value).__name__}"


def _shown(text: str) -> str:
    """A string of a pickle as a message quotes it: its first SHOWN_CHARACTERS (a pickle's strings
    may take 64 MiB)."""
    return repr(text) if len(text) <= SHOWN_CHARACTERS else f"{text[:SHOWN_CHARACTERS]!r}... ({len(text):,} characters)"


def _storage(pid: Any) -> Storage:
    """The storage a persistent id names: ('storage', storage class, key, location, count)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise Refused("a persistent id that is not a storage's ('storage', class, key, location, count)")
    _, kind, key, location, count = pid
    if not isinstance(kind, _StorageClass):
        raise Refused(f"a storage of {_what(kind)}, which is not a torch storage class")
    if not isinstance(key, str) or not isinstance(location, str) or type(count) is not int or count < 0:
        shown = _shown(key) if isinstance(key, str) else _what(key)
        raise Refused(f"storage {shown}: its key, location or size is not what torch writes")
    if kind.dtype_name is None:
        raise Refused(f"storage {_shown(key)}: a torch.{kind.name} (safetensors has no such dtype)")
    return Storage(key, DTYPES[kind.dtype_name] if kind.dtype_name else None, count)


_MARK = object()


def state_dict(data: bytes) -> list[Found]:
    """The tensors of the checkpoint whose pickle is `data` (see tensors()), read within one Budget;
    Refused with the reason when it is not a state dict's pickle."""
    budget = Budget(len(data))
    return tensors(load(data, budget), budget)


def load(data: bytes, budget: Budget) -> Any:
    """What the pickle `data` makes, as this machine builds it (Pairs, lists, tuples, Tensors, ...),
    its work charged to `budget`. Refused with the reason when it is not a state dict's pickle."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    storages: dict[str, Storage] = {}
    keys = _Keys(budget)

    def pop_mark() -> list[Any]:
        if not marks:
            raise Refused("an opcode takes items up to a mark, and there is none")
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    def pop() -> Any:
        if len(stack) <= (marks[-1] if marks else 0):
            raise Refused("an opcode takes an item the stack does not have")
        return stack.pop()

    def top() -> Any:
        if len(stack) <= (marks[-1] if marks else 0):
            raise Refused("an opcode works on an item the stack does not have")
        return stack[-1]

    def top_list() -> list[Any]:
        target = top()
        if not isinstance(target, list) or isinstance(target, Pairs):
            raise Refused(f"appends to {_what(target)}, which is not a list")
        return target

    def put(index: Any) -> None:
        if type(index) is not int or not 0 <= index < MAX_MEMO_INDEX:
            raise Refused(f"a memo index of {index!r}")
        memo[index] = top()

    def set_items(target: Any, items: list[Any]) -> None:
        if not isinstance(target, Pairs) or len(items) % 2:
            raise Refused(f"sets items of {_what(target)}, which is not a dict")
        if not all(map(keys.hashable, items[::2])):
            raise Refused("a dict's key is a list or a dict, which no dict can have (torch refuses it)")
        target.extend(zip(items[::2], items[1::2], strict=True))

    def persisted(pid: Any) -> Storage:
        storage = _storage(pid)
        seen = storages.setdefault(storage.key, storage)
        if seen != storage:
            raise Refused(f"storage {_shown(storage.key)} is named twice, as different storages")
        return seen

    unread = None  # an opcode torch does not read: refused at the end, for a global named is the better reason
    for opcode, arg, _ in _opcodes(data):
        name = opcode.name
        if unread is None and name not in TORCH_OPCODES:
            unread = name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            if len(stack) != 1 or marks:
                raise Refused("the pickle ends with other than one object on its stack")
            if unread is not None:
                raise Refused(f"uses the opcode {unread}, which torch.load(weights_only=True) does not read")
            return stack[0]
        if name == "MARK":
            marks.append(len(stack))
        elif name in _LITERALS:
            stack.append(_LITERALS[name] if arg is None else arg)
        elif name in _ARGUMENT_VALUES:
            stack.append(_text(arg) if name in ("BINSTRING", "SHORT_BINSTRING", "STRING") else arg)
        elif name == "EMPTY_DICT":
            stack.append(Pairs())
        elif name in ("EMPTY_LIST", "EMPTY_SET"):
            stack.append([])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            items = [pop() for _ in range(count)][::-1]
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("LIST", "FROZENSET"):
            stack.append(pop_mark())
        elif name == "DICT":
            items = pop_mark()
            pairs = Pairs()
            set_items(pairs, items)
            stack.append(pairs)
        elif name == "APPEND":
            item = pop()
            top_list().append(item)
        elif name in ("APPENDS", "ADDITEMS"):
            items = pop_mark()
            top_list().extend(items)
        elif name == "SETITEM":
            value, key = pop(), pop()
            set_items(top(), [key, value])
        elif name == "SETITEMS":
            items = pop_mark()
            set_items(top(), items)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            put(arg)
        elif name == "MEMOIZE":
            put(len(memo))
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise Refused(f"gets memo item {arg!r}, which was never put")
            stack.append(memo[arg])
        elif name == "POP":
            pop()
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(top())
        elif name == "GLOBAL":
            module, _, global_name = str(arg).partition(" ")
            stack.append(_lookup(module, global_name))
        elif name == "STACK_GLOBAL":
            global_name, module = pop(), pop()
            if not isinstance(module, str) or not isinstance(global_name, str):
                raise Refused("STACK_GLOBAL of something other than two strings")
            stack.append(_lookup(module, global_name))
        elif name == "REDUCE":
            args = pop()
            stack.append(_call(pop(), args, budget))
        elif name == "BUILD":
            state = pop()
            target = top()
            if not isinstance(target, Pairs | Tensor):  # an OrderedDict's _metadata, a Parameter's attributes
                raise Refused(f"sets the state of {_what(target)}")
            del state
        elif name == "BINPERSID":
            stack.append(persisted(pop()))
        elif name == "PERSID":
            raise Refused("a persistent id in text (torch writes them as objects)")
        elif name == "INST":  # a global and a call in one: the global is refused first, or the opcode
            module, _, global_name = str(arg).partition(" ")
            _lookup(module, global_name)
            raise Refused("uses the opcode INST, which a state dict's pickle never does")
        else:  # OBJ, NEWOBJ, NEWOBJ_EX, EXT1-4, NEXT_BUFFER, READONLY_BUFFER
            raise Refused(f"uses the opcode {name}, which a state dict's pickle never does")
    raise Refused("the pickle has no STOP: truncated")


class _Keys:
    """Which values could be a dict's key, each tuple of a pickle walked once: a key built as a shared
    tree (each level a tuple of two references to the one below) has 2^depth leaves and depth tuples."""

    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self._walked: dict[int, tuple[Any, ...]] = {}
        """The tuples walked, by id (each kept, so that its id is never another's)."""

    def hashable(self, key: Any) -> bool:
        """Whether Python could make `key` a dict's key: no list or dict in it, nor in a tuple
        within. A tuple once walked is not walked again: what it holds never changes, and a key
        found unhashable ends the pickle (Refused)."""
        pending = [key]
        while pending:
            item = pending.pop()
            if isinstance(item, list):  # Pairs (a dict) too
                return False
            if isinstance(item, tuple) and id(item) not in self._walked:
                self._walked[id(item)] = item
                self._budget.charge(1 + len(item))
                pending += item
        return True


TORCH_OPCODES = frozenset({
    "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "BINPERSID", "MARK", "APPEND", "APPENDS",
    "SETITEM", "SETITEMS", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE",
    "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "LONG1",
    "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT",
})  # fmt: skip
"""The opcodes torch.load(weights_only=True) reads (torch/_weights_only_unpickler.py, torch 2.13): a
pickle with another (protocol 4's FRAME and MEMOIZE, protocol 0's text ones) is one it refuses."""


def _text(arg: str) -> str:
    """A protocol 0-2 byte string as torch.load has it: UTF-8 decoded (pickletools gives it as latin-1)."""
    try:
        return arg.encode("latin1").decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("a string that is not UTF-8") from None


_LITERALS: dict[str, Any] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_ARGUMENT_VALUES = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BYTEARRAY8",
}  # fmt: skip


_OPCODES = {opcode.code: opcode for opcode in pickletools.opcodes}


def _line(stream: io.BytesIO) -> str:
    """A line of text, as an unpickler reads a global's module and name (escapes are not undone)."""
    data = stream.readline()
    if not data.endswith(b"\n"):
        raise ValueError("no newline found when trying to read a line")
    return data[:-1].decode("utf-8")


def _quoted(stream: io.BytesIO) -> str:
    """A STRING's text between its quotes, as it is written: torch does not read the opcode (such a
    pickle is refused anyway), and undoing its escapes warns of each unknown one."""
    raw = pickletools.read_stringnl(stream, decode=False)
    return raw.decode("latin-1") if isinstance(raw, bytes) else raw


_TEXT_READERS: dict[str, Callable[[io.BytesIO], str]] = {
    "stringnl": _quoted,
    "stringnl_noescape": _line,
    "stringnl_noescape_pair": lambda stream: f"{_line(stream)} {_line(stream)}",
}
"""Readers of the arguments pickletools decodes with Python's string escapes (a DeprecationWarning for
each it does not know: an exception where warnings are errors), which an unpickler never undoes in a
global's names."""


def _opcodes(data: bytes) -> Iterator[tuple[Any, Any, int | None]]:
    """The pickle's opcodes and their arguments, decoded (never run); Refused where they cannot be.
    pickletools.genops's loop, with _TEXT_READERS for text arguments."""
    stream = io.BytesIO(data)
    try:
        while True:
            position = stream.tell()
            code = stream.read(1)
            opcode = _OPCODES.get(code.decode("latin-1"))
            if opcode is None:
                why = "pickle exhausted before seeing STOP" if not code else f"opcode {code!r} unknown"
                raise Refused(f"not a pickle torch could read: at position {position}, {why}")
            argument = opcode.arg
            reader = None if argument is None else _TEXT_READERS.get(argument.name, argument.reader)
            yield opcode, None if reader is None else reader(stream), position
            if code == b".":
                return
    except (ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise Refused(f"not a pickle torch could read: {exc}") from None


@dataclass(frozen=True, slots=True)
class Found:
    """A tensor of the checkpoint, named by its path of keys from the top (joined with '.')."""

    name: str
    tensor: Tensor


_Prefix = tuple[Any, str] | None
"""The keys above a container, as (the prefix above its own, its key): a name is made only for a
tensor (a chain of 640,000 dicts would make names of a total length of 640,000^2 / 2 otherwise)."""


def tensors(root: Any, budget: Budget) -> list[Found]:
    """Every tensor under the checkpoint's top dict, in order: a state dict's keys are its names; a
    dict within (a checkpoint of {"model": {...}}) adds its key and a '.'. Other values (numbers,
    strings: an epoch, a config) are not tensors, and are left out. A key given twice counts once,
    its last value (as a dict has it), at its first place. Each container is walked once, and each
    item it holds and each name made charged to `budget`."""
    if not isinstance(root, Pairs):
        raise Refused(f"holds {_what(root)}, not a dict of tensors (a state dict)")
    found: dict[str, Tensor] = {}
    seen: set[int] = set()
    pending: list[tuple[_Prefix, Any]] = [(None, root)]
    while pending:
        prefix, container = pending.pop()
        if id(container) in seen:  # a dict reached twice (or within itself): its tensors are named once
            continue
        seen.add(id(container))
        budget.charge(1 + len(container))
        later: list[tuple[_Prefix, Any]] = []
        for key, value in _items(container):
            if not _nameable(key):
                if _holds_tensors(value):
                    raise Refused(f"a tensor under a key of {_what(key)} (names are strings)")
                continue
            if isinstance(value, Tensor):
                name = _name(prefix, str(key), budget)
                if name in found:
                    raise Refused(f"two tensors are named {_shown(name)} (a key with a '.' and a dict within)")
                found[name] = value
            elif isinstance(value, list | tuple):
                later.append(((prefix, str(key)), value))
        pending += reversed(later)
    return [Found(name, tensor) for name, tensor in found.items()]


def _name(prefix: _Prefix, key: str, budget: Budget) -> str:
    """The name of what is under `key` below `prefix`: the keys from the top, joined with '.'."""
    parts = [key]
    while prefix is not None:
        prefix, part = prefix
        parts.append(part)
    name = ".".join(reversed(parts))
    budget.charge(len(parts) + len(name))
    return name


def _items(container: Any) -> list[tuple[Any, Any]]:
    """A dict's items, a key given twice once (its last value, at its first place); a list's by index.
    Keys are compared as the names they make: strings hash unpredictably, ints a pickle can make collide."""
    if not isinstance(container, Pairs):
        return list(enumerate(container))
    named: dict[str, tuple[Any, Any]] = {}
    others = []
    for key, value in container:
        if _nameable(key):
            text = str(key)
            named[text] = (named[text][0] if text in named else key, value)
        else:
            others.append((key, value))
    return list(named.values()) + others


def _nameable(key: Any) -> bool:
    """Whether a key names what is under it: a string, or an int (an optimizer's state is keyed by them)."""
    return isinstance(key, str) or (type(key) is int and abs(key) <= MAX_INT)


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, Tensor | Pairs | list | tuple)
