"""What a store's failures are to callers: each kind of the client's errors told by its type, and a
store's failure never taken for a changed shard."""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorfs
from helpers import MIB, random_bytes, write_reference
from servers import HostileServer, Lie
from tensorfs.errors import AccessDenied, ObjectChanged, ShardChangedError
from tensorfs.sources import client
from tensorfs.sources.failures import RANGE_NEEDED, Failure, failure
from tensorfs.sources.store import ObjectRef, RemoteError, RemoteOptions, StoreSpec, store_spec


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


# -- each kind of the client's errors, told by its type ----------------------------------------------


def _s3(hostile: HostileServer, monkeypatch: pytest.MonkeyPatch) -> StoreSpec:
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    spec, _ = store_spec("s3://bkt/m", RemoteOptions(endpoint_url=hostile.url, timeout=1))
    return spec


@pytest.mark.parametrize(
    ("kind", "raised", "reason"),
    [
        ("404", FileNotFoundError, "not found (404)"),
        ("403", AccessDenied, "access denied (403): check the credentials"),
        ("401", AccessDenied, "authentication required (401): check the credentials"),
        ("412", ObjectChanged, "changed since it was validated (its ETag differs): mount it again"),
        ("listing-403", AccessDenied, "access denied (403): check the credentials"),
        ("listing-401", AccessDenied, "authentication required (401): check the credentials"),
        ("listing-key", RemoteError, "the listing holds a key that is no plain path ('m/a//b')"),
        ("listing-garbage", RemoteError, "the store's answer is not a listing (S3's ListObjectsV2)"),
        ("500", RemoteError, "the server answered 500 Internal Server Error"),
        ("stall", RemoteError, "no answer within --remote-timeout (the store, or the connection to it, stalled)"),
        ("cut", RemoteError, "the answer ended before all its bytes came (the connection was cut)"),
    ],
)
def test_each_kind_of_a_stores_failure_is_its_error(
    hostile: HostileServer, monkeypatch: pytest.MonkeyPatch, kind: str, raised: type[Exception], reason: str
) -> None:
    """Each failure the client reports, made to happen on the wire of an S3 store: the error it is
    (a 403 or 401 to a listing too: AccessDenied, which finding.py takes for a bucket one may read
    and not list), and its reason in words."""
    (hostile.root / "bkt" / "m").mkdir(parents=True)
    (hostile.root / "bkt" / "m" / "f.json").write_bytes(b"{}" * 300_000)
    spec = _s3(hostile, monkeypatch)
    ref = ObjectRef(spec, "m/f.json")
    listing, status = kind.startswith("listing-"), kind.removeprefix("listing-")
    if status.isdigit() and status != "404":
        hostile.lies.append(Lie("status", "bkt/m" if listing else "bkt/m/f.json", int(status)))
    elif kind == "listing-key":
        hostile.lies.append(Lie("name", "bkt/m", "a//b"))
    elif kind == "listing-garbage":
        hostile.lies.append(Lie("listing", "bkt/m", "garbage"))
    elif kind in ("stall", "cut"):
        hostile.lies.append(Lie("body", "bkt/m/f.json", kind))
    with pytest.raises(raised) as caught:
        if listing:
            client.list_objects(spec, "m/")
        elif kind == "404":
            client.get_whole(ObjectRef(spec, "m/missing.json"), 1 << 20)
        elif kind == "412":
            version, _ = client.read_first_bytes(ref, lambda first, size: len(first))
            hostile.lies.append(Lie("etag", "bkt/m/f.json", '"other"'))
            client.read_range(version, 0, 10, lambda offset, piece: None)
        else:
            client.get_whole(ref, 1 << 20)
    where = "s3://bkt/m/" if listing else ("s3://bkt/m/missing.json" if kind == "404" else "s3://bkt/m/f.json")
    assert str(caught.value).startswith(f"{where}: {reason}"), str(caught.value)


def test_a_range_answered_whole_over_http_is_said_so(hostile: HostileServer, tmp_path: Path) -> None:
    """obstore's NotSupportedError (plain HTTP: a range answered 200 with the whole file): what a
    server that cannot serve a model by ranges needs, said."""
    (hostile.root / "m.safetensors").write_bytes(b"x" * 100)
    hostile.lies.append(Lie("range", "m.safetensors", "ignored"))
    spec = StoreSpec("http", hostile.url, hostile.url, timeout=1)
    with pytest.raises(RemoteError) as caught:
        client.read_first_bytes(ObjectRef(spec, "m.safetensors"), lambda first, size: size)
    assert str(caught.value) == f"{hostile.url}/m.safetensors: {RANGE_NEEDED}"


def test_an_error_is_told_by_its_type_not_by_words_in_it() -> None:
    """The client's exceptions, made here: a PreconditionError, PermissionDeniedError or
    UnauthenticatedError is its kind whatever its text; a generic error whose answer was a 500 is
    no change nor refusal however its text (a server's page quoted in it) names one."""
    from obstore import exceptions as errors

    spec = StoreSpec("http", "http://store", "http://store", timeout=1)
    assert failure(errors.PreconditionError("no words of it"), spec).error is ObjectChanged
    assert failure(errors.PermissionDeniedError("no words of it"), spec).error is AccessDenied
    assert failure(errors.UnauthenticatedError("no words of it"), spec).error is AccessDenied
    page = "Server returned non-2xx status code: 500 Internal Server Error: <h1>412 Precondition Failed</h1>"
    said = failure(errors.GenericError(f"Generic HTTP error: Error performing GET http://store/x - {page}"), spec)
    assert said == Failure(RemoteError, "the server answered 500 Internal Server Error")
