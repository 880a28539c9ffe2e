"""One side of the signed suite (signed.py), run as a script (`python signedside.py SIDE ARGS`) in a
process of its own, so that what it imports is counted as a user's first run pays it: nothing of
tensorfs is imported here but by the sides that use it.

Prints one JSON line: the wall clock (time.time()) when its first tensor was read and when the last
was, and what it read (common.BytesRead's "<CRCs hashed>/<bytes>", made here without importing tensorfs).
Each tensor is read whole (its CRC-32C taken: every byte touched, as a consumer's would be).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Reading:
    """The tensors a side read, as common.BytesRead says them, and when its first one was read."""

    def __init__(self) -> None:
        import crc32c

        self._crc = crc32c.crc32c
        self.crcs: list[int] = []
        self.nbytes = 0
        self.first: float | None = None

    def __call__(self, array: Any) -> None:
        data = memoryview(array.reshape(-1).view("uint8")) if array.size else memoryview(b"")
        self.crcs.append(self._crc(data))
        self.nbytes += data.nbytes
        if self.first is None:
            self.first = time.time()

    def said(self) -> str:
        crcs = b"".join(crc.to_bytes(4, "little") for crc in sorted(self.crcs))
        return f"{hashlib.sha256(crcs).hexdigest()[:16]}/{self.nbytes}"


def shards_of(folder: Path) -> list[Path]:
    """The model's weights files in the folder, in the order of their names (as loaders read them)."""
    return sorted(folder.glob("*.safetensors"))


def safetensors_read(folder: Path, read: Reading, first_only: bool) -> None:
    """safetensors reads the folder's files, tensor after tensor in the order of the bytes."""
    from safetensors import safe_open

    for path in shards_of(folder):
        with safe_open(str(path), "np") as opened:
            for name in opened.offset_keys():
                read(opened.get_tensor(name))
                if first_only:
                    return


def model_signing_verify(folder: Path, public: str, shard_size: int | None) -> None:
    """model_signing's verify of the folder (its library: its command line cannot verify a signature
    of ranges), the signature left out of what it hashes, as it was when signed."""
    from model_signing import hashing, verifying

    config = hashing.Config().set_ignored_paths(paths=["model.sig"])  # type: ignore[no-untyped-call]
    if shard_size is not None:
        config = config.use_shard_serialization(shard_size=shard_size)
    verifier = verifying.Config().use_elliptic_key_verifier(public_key=public)  # type: ignore[no-untyped-call]
    verifier.set_hashing_config(config).verify(folder, folder / "model.sig")


def download(url: str, endpoint: str, into: Path) -> Path:
    """The model's objects under an s3:// prefix, written into files (obstore, as the other
    benchmarks download): what a user does before model_signing and safetensors can read them."""
    import os

    import obstore
    from obstore.store import S3Store

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    store = S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ.get("AWS_REGION", "us-east-1"),
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    into.mkdir(parents=True)
    for listed in obstore.list(store, prefix=prefix + "/"):
        for entry in listed:
            relative = entry["path"].removeprefix(prefix + "/")
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as out:
                for chunk in obstore.get(store, entry["path"]).stream(min_chunk_size=8 << 20):
                    out.write(chunk)
    return into


def tensorfs_read(source: str, read: Reading, first_only: bool, **options: Any) -> None:
    """tensorfs.safe_open of the model (signed when options say so), tensor after tensor in the order
    of the bytes; or load_file of it whole."""
    import tensorfs

    if first_only:
        with tensorfs.safe_open(source, "np", **options) as opened:
            read(opened.get_tensor(opened.offset_keys()[0]))
        return
    for tensor in tensorfs.load_file(source, framework="np", **options).values():
        read(tensor)


def _tensorfs_options(args: dict[str, Any]) -> dict[str, Any]:
    import tensorfs

    options: dict[str, Any] = {"cache": args["cache"]}
    if args.get("public"):
        options["signature"] = tensorfs.Signature(public_key=args["public"])
    if args.get("endpoint"):
        options["remote"] = tensorfs.RemoteOptions(endpoint_url=args["endpoint"], cache_dir=args["cache"])
    return options


def sides() -> dict[str, Callable[[dict[str, Any], Reading], None]]:
    def verify_then_load(args: dict[str, Any], read: Reading) -> None:
        folder = Path(args["folder"])
        if args.get("endpoint"):
            folder = download(args["url"], args["endpoint"], folder)
        model_signing_verify(folder, args["public"], args.get("shard_size"))
        safetensors_read(folder, read, args["first_only"])

    def in_process(args: dict[str, Any], read: Reading) -> None:
        tensorfs_read(args["source"], read, args["first_only"], **_tensorfs_options(args))

    def through_folder(args: dict[str, Any], read: Reading) -> None:  # a mount's model folder, by safetensors
        safetensors_read(Path(args["folder"]), read, args["first_only"])

    return {"verify_then_load": verify_then_load, "tensorfs": in_process, "folder": through_folder}


def main(argv: list[str]) -> int:
    side, args = argv[1], json.loads(argv[2])
    read = Reading()
    sides()[side](args, read)
    print(json.dumps({"first": read.first, "end": time.time(), "read": read.said()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
