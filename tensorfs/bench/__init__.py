"""The benchmark (`tensorfs bench`, scripts/bench.py): local.py measures the read path, the mount and
listing of local models, also against peers (peers.py: bindfs and floor.py, the least pyfuse3
daemon); remote.py models read from a store (nginx on loopback) through the cache.

Every figure is the median of several tries, reported as a ratio to its baseline measured in the
same run: these machines are noisy.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import Config, Report

__all__ = ["Config", "Report", "main"]


def main(config: Config, json_path: Path | None = None, *, remote: bool = False) -> int:
    """Run the local benchmark (or, `remote`, the remote one), print its table, and write it as JSON if asked."""
    if remote:
        from .remote import run
    else:
        from .local import run
    report = run(config)
    print(report.table())
    if json_path is not None:
        document = {"config": {k: str(v) for k, v in vars(config).items()}, **report.data, "notes": report.notes}
        json_path.write_text(json.dumps(document, indent=2) + "\n")
    return 0
