"""`tensorfs stats`: a daemon's counters as people read them, and rates between two snapshots."""

from __future__ import annotations

import errno as errnos
from typing import Any

from ..errors import printable
from ..utils.units import human_size
from .stats import quantile


def duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _latency(bound: float | None) -> str:
    if bound is None:
        return "-"
    if bound == float("inf"):
        return "> 10 s"
    return f"< {bound * 1e3:g} ms" if bound < 1 else f"< {bound:g} s"


def render(mountpoint: str, now: dict[str, Any], before: dict[str, Any] | None) -> str:
    """The table for one snapshot; rates are over the interval since `before` (else since start)."""
    since = before or {
        "uptime_seconds": 0.0,
        "read_bytes": dict.fromkeys(now["read_bytes"], 0),
        "reads": dict.fromkeys(now["reads"], 0),
        "read_latency": {"counts": [0] * len(now["read_latency"]["counts"])},
        "errors": [],
    }
    interval = max(now["uptime_seconds"] - since["uptime_seconds"], 1e-9)
    served = sum(now["read_bytes"].values())
    reads = sum(now["reads"].values())
    rate_bytes = (served - sum(since["read_bytes"].values())) / interval
    rate_reads = (reads - sum(since["reads"].values())) / interval
    counts = [a - b for a, b in zip(now["read_latency"]["counts"], since["read_latency"]["counts"], strict=True)]
    buckets = now["read_latency"]["buckets"]
    kinds = ", ".join(f"{kind} {human_size(n)}" for kind, n in now["read_bytes"].items())
    window = f"over the last {interval:.1f} s" if before else "since it started"
    integrity, process = now["integrity"], now["process"]
    touched, total = now["touched_bytes"], now["model_bytes"]
    errors_before = {(e["op"], e["errno"]): e["count"] for e in since["errors"]}
    errors = [
        f"{e['op']} {errnos.errorcode.get(e['errno'], e['errno'])} {e['count']}"
        + (f" (+{e['count'] - errors_before.get((e['op'], e['errno']), 0)})" if before else "")
        for e in now["errors"]
    ]
    lines = [
        f"{mountpoint}  up {duration(now['uptime_seconds'])}  pid {now['pid']}  tensorfs {now['version']}",
        f"served     {human_size(served)} in {reads} reads ({kinds})",
        f"rate       {rate_bytes / 1e6:.1f} MB/s, {rate_reads:.0f} reads/s {window}",
        f"latency    reads p50 {_latency(quantile(buckets, counts, 0.5))}, "
        f"p99 {_latency(quantile(buckets, counts, 0.99))} {window}",
        f"pages      {now['page_waits']} reads waited {now['page_wait_seconds']:.2f} s for pages; "
        f"{now['prefetch_windows']} windows read ahead ({human_size(now['prefetch_bytes'])}; by MiB "
        f"{human_size(now['prefetch_hit_bytes'])} of {human_size(now['prefetch_ahead_bytes'])} read since)",
        f"integrity  {integrity['verified']} tensors verified, {integrity['verify_failures']} refused",
        *_fallback_lines(now.get("fallback")),
        f"files      {now['open_files']} open; {now['tensors_opened']} tensors opened; "
        f"{human_size(touched)} of {human_size(total)} touched ({100 * touched / total if total else 0:.0f}%)",
        f"memory     RSS {human_size(process['rss_bytes'])} (anonymous {human_size(process['rss_anon_bytes'])}), "
        f"{process['threads']} threads, {process['fds']} fds",
        "errors     " + ("; ".join(errors) if errors else "none"),
    ]
    for source, values in now["sources"].items():
        lines.append(
            f"{source:<10} " + ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in values.items())
        )
    return "\n".join(lines)


def _fallback_lines(fallback: dict[str, Any] | None) -> list[str]:
    """Which tensors a fallback serves, and what each fallback served: nothing while none does."""
    if not fallback or not fallback["tensors"]:
        return []
    tensors: dict[str, str] = fallback["tensors"]
    lines = []
    for source in sorted(set(tensors.values()) | set(fallback["reads"])):
        names = sorted(name for name, used in tensors.items() if used == source)
        shown = ", ".join(printable(name) for name in names[:5]) + (f", ... ({len(names)})" if len(names) > 5 else "")
        lines.append(
            f"fallback   {source}: {len(names)} tensors ({shown}), {fallback['reads'].get(source, 0)} reads, "
            f"{human_size(fallback['bytes'].get(source, 0))}"
        )
    return lines
