"""tensorfs bench: the benchmark and its peers (see tensorfs/bench/)."""

from __future__ import annotations

from pathlib import Path

import click

from .group import cli
from .options import READAHEAD_KB, Finite


@cli.command()
@click.option("--quick", is_flag=True, help="A small model and one try of each: checks the benchmark works.")
@click.option("--gib", type=Finite(0.01, 1024), help="Size of the model of big tensors (default 2).")
@click.option("--shards", type=click.IntRange(1, 1000), help="Its shard count (default 4).")
@click.option(
    "--repeat", type=click.IntRange(1, 100), help="Tries of each measurement; medians are reported (default 3)."
)
@click.option("--readahead-kb", type=READAHEAD_KB, help="Passed to each mount (default 1024).")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), help="Where to build (default: $TMPDIR).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), help="Also write the results here."
)
@click.option("--remote", is_flag=True, help="Measure remote models instead: served by nginx, through the cache.")
def bench(
    quick: bool,
    gib: float | None,
    shards: int | None,
    repeat: int | None,
    readahead_kb: int | None,
    workdir: Path | None,
    json_path: Path | None,
    remote: bool,
) -> int:
    """Measure the read path, mount and listing against direct baselines and peers (bindfs, and the
    least pyfuse3 daemon there is: tensorfs/bench/floor.py), in the same run (needs FUSE; root for
    cold reads, and to install bindfs when missing).

    With --remote: a model served by nginx on loopback, read through the mount and its cache, against
    obstore downloading it (needs nginx).
    """
    from .. import bench as benchmark

    config = benchmark.Config.quick() if quick else benchmark.Config()
    for name, value in (("gib", gib), ("shards", shards), ("repeat", repeat), ("readahead_kb", readahead_kb)):
        if value is not None:
            setattr(config, name, value)
    config.workdir = workdir
    return benchmark.main(config, json_path, remote=remote)
