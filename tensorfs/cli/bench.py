"""tensorfs bench: the benchmarks and their peers, one suite at a time (see tensorfs/bench/)."""

from __future__ import annotations

from pathlib import Path

import click

from .group import cli
from .options import READAHEAD_KB, Finite, ParsedText, hidden_alias

SUITES = ("read", "remote", "open", "hash", "small", "load", "formats", "fleet", "signed", "random")
"""tensorfs.bench.SUITES, here without importing the benchmark (numpy) to build the command line."""

FIELDS: dict[str, dict[str, str]] = {
    "read": {"gib": "gib", "shards": "shards", "repeat": "repeat", "readahead_kb": "readahead_kb"},
    "remote": {"gib": "gib", "shards": "shards", "repeat": "repeat", "readahead_kb": "readahead_kb"},
    "open": {"tensors": "open_tensors", "shards": "open_shards", "repeat": "open_repeat"},
    "hash": {"gib": "hash_gib", "shards": "hash_shards", "repeat": "hash_repeat", "tensors": "hash_small_tensors"},
    "small": {"tensors": "small_files_tensors", "repeat": "small_files_repeat"},
    "load": {"gib": "load_gib", "repeat": "load_repeat"},
    "formats": {"gib": "formats_gib", "repeat": "formats_repeat"},
    "fleet": {"gib": "fleet_gib", "shards": "fleet_shards", "repeat": "fleet_repeat", "nodes": "fleet_nodes"},
    "signed": {"gib": "signed_gib", "shards": "signed_shards", "repeat": "signed_repeat"},
    "random": {"gib": "random_gib", "repeat": "random_repeat"},
}
"""The Config field each option sets, by suite; an option a suite has no field for is refused."""

RESULTS_FILE = click.Path(path_type=Path, dir_okay=False)


def _node_counts(text: str) -> tuple[int, ...]:
    """--nodes 1,2,4: counts of nodes, each from 1 to 32."""
    try:
        counts = tuple(int(word) for word in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a list of node counts like 1,2,4") from None
    if not all(1 <= count <= 32 for count in counts):
        raise ValueError(f"{text!r}: each count of nodes is from 1 to 32")
    return counts


@cli.command(short_help="Measure tensorfs against baselines and peers in the same run.")
@click.option("--quick", is_flag=True, help="A small model and one try of each: checks the benchmark works.")
@click.option("--gib", type=Finite(0.01, 1024), help="Size of the model of big tensors (default 2).")
@click.option("--shards", type=click.IntRange(1, 1000), help="Its shard count (default 4).")
@click.option(
    "--repeat", type=click.IntRange(1, 100), help="Tries of each measurement; medians are reported (default 3)."
)
@click.option("--readahead-kb", type=READAHEAD_KB, help="Passed to each mount (default 1024).")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Where to build (default: $TMPDIR).",
)
@hidden_alias("--json", "--output", type=RESULTS_FILE)
@click.option("-o", "--output", type=RESULTS_FILE, help="Also write the results here, as JSON.")
@click.option(
    "--suite",
    type=click.Choice(SUITES),
    help="What to measure (default: read). The defaults of --gib, --shards and --repeat above are read's.",
)
@click.option(
    "--tensors",
    type=click.IntRange(0, 10_000_000),
    help="Tiny tensors in the model of open (default 100000), of small (60000), of hash's second (60000; 0: none).",
)
@click.option(
    "--nodes",
    type=ParsedText("N[,N...]", _node_counts),
    help="The counts of nodes fleet measures, each against one (default 1,2,4).",
)
@click.option(
    "--remote",
    is_flag=True,
    help="Measure remote models instead: served by nginx, through the cache. The same as --suite remote.",
)
def bench(
    quick: bool,
    gib: float | None,
    shards: int | None,
    repeat: int | None,
    readahead_kb: int | None,
    workdir: Path | None,
    output: Path | None,
    suite: str | None,
    tensors: int | None,
    nodes: tuple[int, ...] | None,
    remote: bool,
) -> int:
    """Measure tensorfs against baselines and peers measured in the same run, one suite at a time
    (--suite; see tensorfs/bench/):

    read (the default): the read path, mount and listing against direct baselines and peers (bindfs,
    and the least pyfuse3 daemon there is: tensorfs/bench/floor.py), in the same run (needs FUSE;
    root for cold reads, and to install bindfs when missing). --gib 2, --shards 4, --repeat 3.

    remote (or --remote): a model served by nginx on loopback, read through the mount and its cache,
    against obstore downloading it into files, on loopback and through a distant link (25 ms each
    way, 200 MB/s shared: a proxy in the benchmark); the daemon's CPU (needs nginx; root to drop the
    page cache between sides). --gib 2, --shards 4, --repeat 3.

    open: tensorfs.open_model of a model of many tiny tensors against safetensors.safe_open().keys(),
    in this process. --tensors 100000, --shards 20, --repeat 9.

    hash: `tensorfs manifest` against sha256sum, and what the hash cache costs and saves. --gib 1,
    --shards 4, --repeat 3, --tensors 60000 (a second model, of tiny tensors; 0 skips it).

    small: sha256sum -c, cp -r, find and ls -lR over a mount against a local copy of its tree, and
    through the pyfuse3 floor (needs FUSE). --tensors 60000, --repeat 1.

    load: the in-process loader (tensorfs.safe_open, load_file, verification, tensors() ahead)
    against safetensors and the Run:ai Model Streamer, local and from nginx and SeaweedFS (needs
    FUSE, nginx; root for cold reads). --gib 1, --repeat 3.

    formats: GGUF and PyTorch checkpoints against safetensors (mounting, reads through the mount,
    opening 3,000 tensors) and GGUF against modelvet (validating a 262k-token vocabulary); needs
    FUSE. --gib 1, --repeat 3.

    fleet: N nodes, each in a network namespace of its own, reading one model (the whole of it, and a
    stage of it each) through a caching tier (nginx, contrib/nginx-tier.conf) from a SeaweedFS
    cluster, against one node: the aggregate rate, and the store's egress (needs FUSE, root, nginx,
    weed). --gib 1, --shards 4, --repeat 3, --nodes 1,2,4.

    signed: a model held to an OpenSSF Model Signing signature (files signed whole, and by 16 MiB
    ranges), in-process and mounted, local and from SeaweedFS, against model_signing's verify then
    safetensors; each side a process of its own (needs FUSE, weed, model_signing). --gib 4,
    --shards 4, --repeat 3.

    random: random readers of one big tensor, 4 KiB and 1 MiB reads at random offsets, page cache
    dropped (needs FUSE, root), through the mount against the file and bindfs; and what the daemon
    read ahead of them against what it served. --gib 1, --repeat 3.
    """
    from .. import bench as benchmark

    if remote:
        if suite not in (None, "remote"):
            raise click.UsageError(f"--remote is --suite remote: not --suite {suite}")
        suite = "remote"
    suite = suite or "read"
    fields = FIELDS[suite]
    config = benchmark.Config.quick() if quick else benchmark.Config()
    given = {"gib": gib, "shards": shards, "repeat": repeat, "readahead_kb": readahead_kb, "tensors": tensors,
             "nodes": nodes}  # fmt: skip
    for option, value in given.items():
        if value is None:
            continue
        if option not in fields:
            flag = "--" + option.replace("_", "-")
            takes = [name for name, known in FIELDS.items() if option in known]
            raise click.UsageError(f"{flag} is for the suites {', '.join(takes)}, not {suite}")
        if option == "tensors" and value == 0 and suite != "hash":
            raise click.UsageError(f"--tensors 0 only skips hash's model of tiny tensors; {suite} needs some")
        setattr(config, fields[option], value)
    config.workdir = workdir
    return benchmark.main(config, output, suite=suite)
