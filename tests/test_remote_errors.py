"""What a store's failures are to callers: each kind of the client's errors told by its type, and a
store's failure never taken for a changed shard."""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorfs
from helpers import MIB, random_bytes, write_reference
from servers import HostileServer, Lie
from tensorfs.errors import ShardChangedError
from tensorfs.sources.store import RemoteError, RemoteOptions


def test_a_remote_read_that_times_out_is_a_remote_error_not_a_changed_shard(
    hostile: HostileServer, tmp_path: Path
) -> None:
    """The loader's read of a tensor from a store that stalls mid-answer: a RemoteError that says
    the store stalled, never a ShardChangedError (a caller that reopens on that would ask a stalled
    store forever)."""
    blob = random_bytes(3 * MIB, 1)
    write_reference(hostile.root / "m.safetensors", {"w": ("U8", [len(blob)], blob)})
    options = RemoteOptions(timeout=1, cache_dir=tmp_path / "cache")
    with tensorfs.safe_open(f"{hostile.url}/m.safetensors", framework="numpy", remote=options) as model:
        hostile.lies.append(Lie("body", "m.safetensors", "stall"))
        with pytest.raises(RemoteError, match=r"no answer within --remote-timeout") as caught:
            model.get_tensor("w")
    assert not isinstance(caught.value, ShardChangedError)
    assert "tensor 'w'" in str(caught.value)
