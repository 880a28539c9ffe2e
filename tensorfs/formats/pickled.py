"""A PyTorch checkpoint's data.pkl, read without running it: a small pickle machine that knows only
what `torch.save` writes for a state dict.

Python's own unpickler calls whatever a pickle names (its REDUCE is a function call), keeps a memo
as large as the biggest index a pickle gives, and builds dicts whose keys a pickle chooses (ints
that all hash alike make each insertion as slow as the dict is long): none of that fits a file
another user wrote. This machine walks the opcodes (pickletools decodes them, without building
anything), and builds only lists, tuples, strings, numbers and its own records: a dict is its list
of pairs, a global is a name looked up among the few torch.save's pickle names (torchglobals.py:
anything else is refused before anything is made of it, naming the global), and "calling" an
allowed global makes one of its records. So
nothing of a pickle ever runs, memory stays in proportion to its length, and time too: every walk
over what it built is a loop (a structure nested 100,000 deep is no deeper a stack), each shared
structure is walked once (a key of 2^60 leaves made of 60 tuples, each twice the one below, costs
60 steps), and what the calls copy, the walks visit and the names made take is charged to one
Budget, in proportion to the pickle's length.
"""

from __future__ import annotations

import io
import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .torchglobals import MAX_INT, Budget, Pairs, Refused, Storage, Tensor, call, lookup, shown, storage, what

__all__ = ["Budget", "Found", "Refused", "load", "state_dict", "tensors"]

MAX_MEMO_INDEX = 1 << 32
"""Memo indices a pickle may use (the protocol's own widest): the memo is a dict, never an array."""
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
            raise Refused(f"appends to {what(target)}, which is not a list")
        return target

    def put(index: Any) -> None:
        if type(index) is not int or not 0 <= index < MAX_MEMO_INDEX:
            raise Refused(f"a memo index of {index!r}")
        memo[index] = top()

    def set_items(target: Any, items: list[Any]) -> None:
        if not isinstance(target, Pairs) or len(items) % 2:
            raise Refused(f"sets items of {what(target)}, which is not a dict")
        if not all(map(keys.hashable, items[::2])):
            raise Refused("a dict's key is a list or a dict, which no dict can have (torch refuses it)")
        target.extend(zip(items[::2], items[1::2], strict=True))

    def persisted(pid: Any) -> Storage:
        named = storage(pid)
        seen = storages.setdefault(named.key, named)
        if seen != named:
            raise Refused(f"storage {shown(named.key)} is named twice, as different storages")
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
            stack.append(lookup(module, global_name))
        elif name == "STACK_GLOBAL":
            global_name, module = pop(), pop()
            if not isinstance(module, str) or not isinstance(global_name, str):
                raise Refused("STACK_GLOBAL of something other than two strings")
            stack.append(lookup(module, global_name))
        elif name == "REDUCE":
            args = pop()
            stack.append(call(pop(), args, budget))
        elif name == "BUILD":
            state = pop()
            target = top()
            if not isinstance(target, Pairs | Tensor):  # an OrderedDict's _metadata, a Parameter's attributes
                raise Refused(f"sets the state of {what(target)}")
            del state
        elif name == "BINPERSID":
            stack.append(persisted(pop()))
        elif name == "PERSID":
            raise Refused("a persistent id in text (torch writes them as objects)")
        elif name == "INST":  # a global and a call in one: the global is refused first, or the opcode
            module, _, global_name = str(arg).partition(" ")
            lookup(module, global_name)
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
        raise Refused(f"holds {what(root)}, not a dict of tensors (a state dict)")
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
                    raise Refused(f"a tensor under a key of {what(key)} (names are strings)")
                continue
            if isinstance(value, Tensor):
                name = _name(prefix, str(key), budget)
                if name in found:
                    raise Refused(f"two tensors are named {shown(name)} (a key with a '.' and a dict within)")
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
