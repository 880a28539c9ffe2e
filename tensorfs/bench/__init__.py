"""The benchmarks, all of them `tensorfs bench --suite SUITE`:

- read (the default): local.py measures the read path, the mount and listing of local models, also
  against peers (peers.py: bindfs and floor.py, the least pyfuse3 daemon);
- remote (also `--remote`): remote.py, models read from a store (nginx on loopback) through the cache;
  and bucket.py, a model in SeaweedFS (S3) read through tensorfs's mount, s3fs-fuse and rclone's, against
  a download into files, each side's CPU per GiB beside its rate;
- open: opening.py, tensorfs.open_model of a 100k-tensor model against safetensors.safe_open().keys();
- hash: hashing.py, `tensorfs manifest` against sha256sum, and what the hash cache costs and saves;
- small: small.py, small files and metadata commands over a mount against a local copy, and the
  pyfuse3 floor's;
- load: loading.py, the in-process loader against safetensors and the Run:ai Model Streamer;
- formats: formats.py, GGUF against safetensors (mount, reads) and against modelvet (validating);
- signed: signed.py, a model held to an OpenSSF Model Signing signature (in-process, mounted; local
  and from SeaweedFS) against model_signing's verify then safetensors, each side a process of its own;
- random: randomreads.py, random readers of a big tensor (4 KiB and 1 MiB) through the mount, against
  the file and bindfs, and what was read ahead of them;
- fleet: fleet.py, N nodes (network namespaces) reading one model through a caching tier (nginx) from
  a SeaweedFS cluster (cluster.py), against one node: the aggregate rate and the store's egress.

Why one home: one command that anyone with the package can run on their own machine, no checkout
needed; one report format, each figure a ratio to its baseline measured in the same run (these
machines are noisy: every figure is the median of several tries); one JSON document (-o FILE);
one set of servers (servers.py) and peers (peers.py, floor.py); and every suite checked by the
tests with --quick.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..fs.writer import write_whole
from .common import Config, Report, compile_package

__all__ = ["SUITES", "Config", "Report", "main"]

SUITES = ("read", "remote", "open", "hash", "small", "load", "formats", "fleet", "signed", "random")


def main(config: Config, json_path: Path | None = None, *, suite: str = "read") -> int:
    """Run one suite of the benchmark, print its table, and write it as JSON if asked."""
    if suite == "read":
        from .local import run
    elif suite == "remote":
        from .remote import run
    elif suite == "open":
        from .opening import run
    elif suite == "hash":
        from .hashing import run
    elif suite == "small":
        from .small import run
    elif suite == "load":
        from .loading import run
    elif suite == "formats":
        from .formats import run
    elif suite == "fleet":
        from .fleet import run
    elif suite == "signed":
        from .signed import run
    elif suite == "random":
        from .randomreads import run
    else:
        raise ValueError(f"no benchmark suite {suite!r} (the suites: {', '.join(SUITES)})")
    uncompiled = compile_package()
    report = run(config)
    if uncompiled is not None:
        report.notes.append(uncompiled)
    print(report.table())
    if json_path is not None:
        document = {"config": {"suite": suite, **config.settings(suite)}, **report.data, "notes": report.notes}
        text = json.dumps(document, indent=2) + "\n"
        write_whole(json_path, lambda out: out.write(text.encode()))
    return 0
