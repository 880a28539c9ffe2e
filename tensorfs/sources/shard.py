"""Where a shard's bytes come from, behind one small interface that the model and the read path use.

A shard is a local file (local.py) or an object in a store, read through a local cache. Opened,
either is a read-only mapping (the file, or the object's cache file) and a way to make a range
of it present on a worker thread: nothing above this package knows where bytes come from.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

from ..errors import ShardChangedError
from ..fs.syscalls import map_private, unmap
from ..utils.identity import Identity, ShardKey
from .pages import Pages

_private_made = threading.Lock()


class PrivateMapping:
    """A private copy-on-write mapping of a whole file (MAP_PRIVATE): pages written are the writer's
    own copies; the file and every other mapping of it never see them. It keeps no descriptor, and
    is unmapped when the last array or tensor on it goes."""

    def __init__(self, fd: int, size: int) -> None:
        self._after: list[Callable[[], None]] = []  # what closing left to do once it is unmapped
        if not size:
            self.view = memoryview(bytearray())
        else:
            address = map_private(fd, size)
            memory = (ctypes.c_char * size).from_address(address)
            weakref.finalize(memory, _unmapped, address, size, self._after)
            self.view = memoryview(memory).cast("B")
        self.pages = Pages(self.view)

    def close(self, then: Callable[[], None]) -> None:
        """Let go of it, then call `then`: now, or when the last view of it goes."""
        if not len(self.view):
            then()
            return
        self._after.append(then)
        self.view.release()  # views made of it keep the memory; when none is left, it is unmapped


def _unmapped(address: int, size: int, after: list[Callable[[], None]]) -> None:
    unmap(address, size)
    for close in after:
        with contextlib.suppress(BufferError):  # a view of the shared mapping still alive keeps that one
            close()


class ShardData(ABC):
    """An opened shard: its bytes, validated, mapped read-only, and the ways to reach them safely."""

    key: ShardKey
    label: str
    """How messages name it: its path or URL, as given."""
    view: memoryview
    """The whole shard, on a read-only mapping: zero-copy views and read replies come from it."""
    needs_ensure = False
    """Whether a range must be ensured before any view of it is handed out: a file's pages fault in
    by themselves, but a cache file's unfetched chunks are holes, which read as zeros."""
    wait_limit: float | None = None
    """How long a request waits on work shared with others for its bytes (waits.py): a store's
    --remote-timeout; None: a file's bytes come as fast as the disk gives them."""

    @abstractmethod
    def ensure(self, start: int, end: int, *, ahead: bool = False, within: Within = None) -> bool:
        """Bring [start, end) into memory, mapped (blocking: call it from a worker thread).

        False when the bytes are gone from the file; TensorfsError when they cannot be fetched.
        Either way the caller answers EIO: only a range ensured may be touched through the
        mapping. `ahead`: not a reader's request but a window ahead of one (a reader's requests
        tell a source how it reads). `within`: the bytes of the tensor being read, which a source
        reads ahead past only for a reader that went on into it from the tensor before.
        """

    def resident(self, start: int, end: int) -> bool:
        """Whether [start, end) is in memory already, asked without blocking (False: don't know)."""
        return False

    def held(self, start: int, end: int) -> bool:
        """Whether [start, end) can be had without asking where the shard comes from (a remote
        shard's chunks all in its cache); False for a file, which is where its bytes come from."""
        return False

    def pin(self, start: int, end: int) -> bool:
        """Hold [start, end) present until unpin(): True if it is (a file's bytes always are)."""
        return True

    def unpin(self, start: int, end: int) -> None:  # noqa: B027 - a file has nothing to let go of
        """Let go of what pin() held."""

    def ensure_pinned(self, start: int, end: int, *, within: Within = None) -> None:
        """Make [start, end) present and pin it (blocking: a worker thread); ShardChangedError when its
        bytes cannot be had (or kept), a fetch's own error as it is."""
        for _ in range(8):  # a chunk evicted between its fetch and the pin is fetched again
            if not self.ensure(start, end, within=within):
                raise ShardChangedError(f"{self.label}: bytes [{start}, {end}) cannot be read")
            if self.pin(start, end):
                return
        raise ShardChangedError(f"{self.label}: bytes [{start}, {end}) {EVICTED_AGAIN}")

    def served(self, start: int, end: int) -> None:  # noqa: B027 - a source may keep its pages
        """A mount's reply of [start, end) has gone: the kernel keeps those bytes in the mounted file's
        own pages, and the source's copy of them may go (pages.Handover), at the next flush(). On the
        mount's thread: it only counts."""

    def goes_on_into(self, then: ShardData, data_start: int) -> None:  # noqa: B027 - a source may read ahead alone
        """`then` is the shard after this one in its model (its data starting at `data_start`): a
        reader going through the model front to back goes on into it, and a source may fetch its
        first bytes ahead of that reader."""

    def window_end(self, end: int, prefetch: int) -> int:
        """Where the window brought in after a read that ends at `end` ends: `prefetch` bytes on."""
        return end + prefetch

    def pinned_or_copied(self, start: int, end: int, *, within: Within = None) -> bytes | None:
        """[start, end) for a read's answer (blocking: a worker thread): made present and pinned (None:
        answer from the mapping, then unpin), or a copy of its bytes, made as soon as they have come
        where the rest of their chunk is still coming (a remote source)."""
        self.ensure_pinned(start, end, within=within)
        return None

    # -- the private mapping: what the in-process API's arrays and tensors are made on ----------
    _private: PrivateMapping | None = None

    @abstractmethod
    def mapped_file(self) -> tuple[int, int]:
        """(descriptor, size) of the file the shard is mapped from (the shard's, or its cache file)."""

    def private_view(self) -> memoryview:
        """The whole shard on a private copy-on-write mapping of its file, made once: writable, and no
        write ever reaches the file. Where needs_ensure, a range must be ensured (and pinned) before
        anything looks at its bytes."""
        if self._private is None:
            with _private_made:
                if self._private is None:
                    self._private = PrivateMapping(*self.mapped_file())
        return self._private.view

    def ensure_private(self, start: int, end: int, *, within: Within = None) -> bool:
        """ensure() [start, end), and map its pages in the private mapping too (no fault when touched)."""
        self.private_view()
        assert self._private is not None
        if self.needs_ensure and not self.ensure(start, end, ahead=True, within=within):
            return False
        return self._private.pages.populate(start, end)

    def close_private(self, then: Callable[[], None]) -> None:
        """Let go of the private mapping, then call `then` (the rest of closing); while an array or a
        tensor on it is alive, both wait until the last one goes (a cache file's chunks must stay)."""
        if self._private is None:
            then()
        else:
            self._private.close(then)

    @abstractmethod
    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` from `offset` without touching the mapping (ShardChangedError if the bytes are gone)."""

    def read_cached(self, offset: int, count: int) -> bytes | None:
        """Bytes [offset, offset + count) if the page cache holds them all now (never waiting on a
        disk: the request thread asks), else None."""
        return None

    def readinto_exact(self, offset: int, buffer: memoryview) -> None:
        """readinto(), a file asking its disk for these bytes and no more (no read-ahead, which a
        stream's reads set): bytes read back to be checked (served already, so mostly in memory),
        and a random reader's."""
        self.readinto(offset, buffer)

    def read_exact(self, offset: int, count: int) -> bytes:
        """readinto_exact(), as new bytes."""
        buffer = bytearray(count)
        self.readinto_exact(offset, memoryview(buffer))
        return bytes(buffer)

    def read(self, offset: int, count: int) -> bytes:
        """readinto(), as new bytes (a format's Reader)."""
        buffer = bytearray(count)
        self.readinto(offset, memoryview(buffer))
        return bytes(buffer)

    @abstractmethod
    def identity(self) -> Identity | None:
        """The identity of the bytes validated, if the shard still holds them; None if it changed since."""

    identity_proves_bytes = True
    """Whether a hash kept by identity() is a hash of the bytes read now: a file's identity changes
    when the kernel reports any change of it. Not a remote object's: its version is the store's word,
    and its bytes come again through a cache other processes fill (see Hasher.hash_all)."""

    @abstractmethod
    def status(self) -> os.stat_result:
        """Owner, mode and times to show for the shard's files: as it is now."""

    def watched(self) -> tuple[int, os.stat_result] | None:
        """(descriptor, status when validated) of a file to watch for changes; None: nothing to watch."""
        return None

    def hold_to_manifest(self) -> None:  # noqa: B027 - a file's bytes are checked by the watch
        """A manifest is in force: bytes that come again must be those that passed it (a remote shard
        keeps the SHA-256 of every chunk it fetches, and refuses a chunk that comes otherwise)."""

    def refused(self, start: int, end: int) -> bool:
        """Bytes [start, end) were proven not the model's (a manifest or a signature refused them): a
        source that keeps a copy of them (a remote object's chunk cache) forgets it, so that the next
        read has them again from where they come from. Whether it did (a file's bytes are its own:
        there is nothing to have again until it changes)."""
        return False

    def refetches(self) -> int:
        """How many times bytes this source keeps were refused and are had again (refused()): to every
        model reading it in this process, a change of its bytes (a file's changes are the watch's)."""
        return 0

    def proven(self, start: int, end: int, header: int = 0) -> None:  # noqa: B027 - a file's bytes are its own
        """Bytes [start, end) as they are now are proven the model's (a manifest's or a signature's
        digest): a source that had some of them again after a refusal keeps them as the object's from
        now on (`header`: how many first bytes of it the model's table was read from)."""

    def flush(self) -> None:  # noqa: B027 - most sources have nothing to flush
        """Make what was fetched into a cache known to other processes, and safe from a crash; let go
        of the pages a mount has served whole since (see served()). Called off the serving thread."""

    @abstractmethod
    def describe(self) -> object:
        """What reopen() needs to open the same bytes again in another process (picklable)."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the mapping (a view still alive keeps it until it goes) and of the descriptors."""


Within = tuple[int, int] | None
"""The bytes [start, end) of the tensor a read is of (None: not said)."""

EVICTED_AGAIN = (
    "were evicted again each time they were fetched: the cache is too small for what is read at once; "
    "raise --cache-size"
)
