"""The scripts under scripts/ (the demo, the soak) and every suite of `tensorfs bench`, run with
--quick, keep working (no timings are asserted: those are the benchmark's)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import DROP_CACHES, Mounts, machine_lock, missing_drop_caches, require, wait_until
from helpers import MIB, blocked_in, cli, patience, read_line, reap
from servers import Nginx
from tensorfs.proof.integrity import HASH_WORKERS

ROOT = Path(__file__).resolve().parent.parent


def bench_quick(suite: str, tmp_path: Path, timeout: float = 120) -> dict[str, Any]:
    """`tensorfs bench --suite SUITE --quick`, its JSON report."""
    out = tmp_path / "bench.json"
    command = ["bench", "--suite", suite, "--quick", "--workdir", str(tmp_path), "--json", str(out)]
    result = cli(*command, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def figures(report: dict[str, Any]) -> set[str]:
    """The figures of a benchmark's JSON report (what is not its configuration or its notes)."""
    return set(report) - {"config", "notes"}


def divides(report: dict[str, Any], key: str, numerator: float, denominator: float) -> None:
    """The figure's ratio is the quotient of the two times it compares (as reported, to three places),
    each a time a side took (more than none)."""
    assert numerator > 0 and denominator > 0, (key, numerator, denominator)
    assert report[key]["ratio"] == pytest.approx(numerator / denominator, abs=0.0011), (key, report[key])


def seconds(report: dict[str, Any], key: str) -> float:
    value: float = report[key]["seconds"]
    return value


def test_bench_open_runs(tmp_path: Path) -> None:
    report = bench_quick("open", tmp_path)  # --quick: 2000 tensors in 3 shards, one try
    assert figures(report) == {"safe_open_keys", "open_model", "open_model_cached"} and report["notes"] == []
    assert report["safe_open_keys"]["tensors"] == 2000
    divides(report, "open_model", seconds(report, "open_model"), seconds(report, "safe_open_keys"))
    divides(report, "open_model_cached", seconds(report, "open_model_cached"), seconds(report, "safe_open_keys"))
    # each side read the same table: every tensor's name, dtype and shape
    tables = {report[key]["table"] for key in ("safe_open_keys", "open_model", "open_model_cached")}
    assert len(tables) == 1 and None not in tables, tables


def test_bench_hash_runs(tmp_path: Path) -> None:
    # --quick: 0.13 GiB, two tensors of 64 MiB in 2 shards (the parallel sha256sum has two to share),
    # one try; 2000 tiny tensors, one try.
    report = bench_quick("hash", tmp_path)
    assert figures(report) == {
        "sha256sum", "sha256sum_parallel", "manifest_command", "manifest_command_one", "manifest_in_process",
        "manifest_cached", "manifest_command_cached", "small_no_cache", "small_fresh_cache",
    } and report["notes"] == []  # fmt: skip
    assert report["sha256sum"]["bytes"] > 64 << 20
    divides(report, "manifest_in_process", seconds(report, "sha256sum"), seconds(report, "manifest_in_process"))
    divides(report, "manifest_cached", seconds(report, "manifest_cached"), seconds(report, "manifest_in_process"))
    first_command = seconds(report, "manifest_command")
    divides(report, "manifest_command_one", seconds(report, "sha256sum"), first_command)
    divides(report, "manifest_command_cached", seconds(report, "manifest_command_cached"), first_command)
    # The fair baseline: as many sha256sum processes as tensorfs has hashing threads, one a tensor.
    assert report["sha256sum_parallel"]["hash_workers"] == HASH_WORKERS and report["sha256sum_parallel"]["tensors"] >= 2
    divides(report, "manifest_command", seconds(report, "sha256sum_parallel"), first_command)
    # sha256sum and tensorfs hashed the same bytes: the same hashes
    sums = {report[key]["sums"] for key in ("sha256sum_parallel", "manifest_command", "manifest_in_process")}
    assert len(sums) == 1 and None not in sums, sums
    small = report["small_no_cache"]
    assert small["tensors"] == 2000 and small["repeat"] == 1
    divides(report, "small_fresh_cache", seconds(report, "small_fresh_cache"), seconds(report, "small_no_cache"))
    assert small["manifest"] == report["small_fresh_cache"]["manifest"]  # the same manifest, cached or not


def test_bench_small_runs(fuse: None, tmp_path: Path) -> None:
    report = bench_quick("small", tmp_path, timeout=300)  # --quick: 300 tensors, one try
    commands = ("sha256sum_c", "cp_r", "find_wc", "ls_lR")
    sides = ("", "_again", "_local", "_floor", "_floor_again", "_floor_local")
    assert figures(report) == {command + side for command in commands for side in sides}
    results = {row["command"]: row for row in report.values() if isinstance(row, dict) and "command" in row}
    assert set(results) == {"sha256sum -c", "cp -r", "find -type f | wc -l", "ls -lR"}
    for row in results.values():
        assert row["ratio"] > 0 and row["floor_ratio"] > 0
    # What the kernel was told once it does not ask again: one flush, at most, for 300 closes.
    assert results["sha256sum -c"]["requests"]["open"] >= 300
    assert results["sha256sum -c"]["requests"].get("flush", 0) <= 1


def test_bench_load_runs(fuse: None, nginx: Nginx, tmp_path: Path) -> None:  # nginx: it is there
    # --quick: 1/16 GiB of 8 MiB tensors, one try; its own nginx and SeaweedFS.
    report = bench_quick("load", tmp_path, timeout=600)
    local = ("load_safetensors", "load_safe_open", "load_load_file", "load_runai_local")
    remote = (
        "load_remote_mount", "load_remote_nginx", "load_remote_runai", "load_remote_s3", "load_remote_s3_mount",
        "load_remote_s3torch",
    )  # fmt: skip
    verified = ("load_verified_warm", "load_verified_scratch")
    assert figures(report) == {*local, *remote, *verified, "load_overlap"} and report["notes"] == []
    # every side read the same tensors, whatever the order they came in (the streamer's is its own)
    read = {report[key]["read"] for key in (*local, *remote, *verified)} | {
        report["load_verified_warm"]["unverified_read"]
    }
    assert len(read) == 1 and read != {None}, read
    assert report["load_safetensors"]["nbytes"] >= 64 << 20
    reference = seconds(report, "load_safetensors")
    for key in ("load_safe_open", "load_load_file", "load_runai_local"):
        divides(report, key, reference, seconds(report, key))
    warm = report["load_verified_warm"]
    divides(report, "load_verified_warm", warm["seconds"], warm["unverified_seconds"])
    scratch = report["load_verified_scratch"]
    divides(
        report, "load_verified_scratch", scratch["seconds"], warm["unverified_seconds"] + scratch["hashing_seconds"]
    )
    divides(report, "load_remote_nginx", seconds(report, "load_remote_mount"), seconds(report, "load_remote_nginx"))
    runai = seconds(report, "load_remote_runai")
    divides(report, "load_remote_s3", runai, seconds(report, "load_remote_s3"))
    divides(report, "load_remote_s3_mount", runai, seconds(report, "load_remote_s3_mount"))
    # s3torchconnector (AWS's CRT client) read the whole object: load_file's bar is against its time
    divides(report, "load_remote_s3torch", seconds(report, "load_remote_s3torch"), seconds(report, "load_remote_s3"))
    assert report["load_remote_s3torch"]["at_least"] == 1.0
    overlap = report["load_overlap"]  # root, here: the page cache dropped
    longer = max(overlap["reading_seconds"], overlap["computing_seconds"])
    divides(report, "load_overlap", overlap["seconds"], longer)


def test_bench_load_says_in_one_line_that_s3torchconnector_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorfs.bench.loading import s3torch_missing

    assert s3torch_missing() is None  # installed with the test extra
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)  # what an import of a missing package meets
    said = s3torch_missing()
    assert said is not None and said.startswith("s3torchconnector not measured:") and "\n" not in said


def test_bench_formats_runs(fuse: None, tmp_path: Path) -> None:
    # --quick: a 16k-token vocabulary, 1/16 GiB of tensors, one try.
    report = bench_quick("formats", tmp_path, timeout=600)
    formats = ("safetensors", "gguf", "pytorch")
    assert figures(report) == {
        "formats_modelvet", "formats_validate", "formats_validate_cached", "formats_gguf_reader",
        "formats_open_many_safetensors", "formats_open_many_pytorch",
        *(f"formats_{what}_{name}" for what in ("mount", "read") for name in formats),
    } and report["notes"] == []  # fmt: skip
    # reading the same tensors through the mount of each format: the same bytes
    read = {report[f"formats_read_{name}"]["read"] for name in formats}
    assert len(read) == 1 and read != {None}, read
    modelvet = seconds(report, "formats_modelvet")
    divides(report, "formats_validate", seconds(report, "formats_validate"), modelvet)
    divides(report, "formats_validate_cached", seconds(report, "formats_validate_cached"), modelvet)
    divides(report, "formats_gguf_reader", seconds(report, "formats_gguf_reader"), modelvet)
    many = seconds(report, "formats_open_many_safetensors")
    divides(report, "formats_open_many_pytorch", seconds(report, "formats_open_many_pytorch"), many)
    for name in ("gguf", "pytorch"):
        mounting, reading = seconds(report, "formats_mount_safetensors"), seconds(report, "formats_read_safetensors")
        divides(report, f"formats_mount_{name}", seconds(report, f"formats_mount_{name}"), mounting)
        divides(report, f"formats_read_{name}", reading, seconds(report, f"formats_read_{name}"))


def test_bench_fleet_runs(fuse: None, tmp_path: Path) -> None:
    """--quick: 1/16 GiB in 2 shards, one try of 1 node and of 2 (the whole model each, and a stage
    each); its own SeaweedFS cluster, tier and nodes (root: network namespaces). Nothing left behind."""
    from tensorfs.bench.fleet import unusable

    require("the fleet's parts", unusable())
    report = bench_quick("fleet", tmp_path, timeout=600)
    assert report["notes"] == []  # nothing skipped
    keys = ("fleet_whole_1", "fleet_whole_2", "fleet_stages_2")
    assert figures(report) == {*keys, *(f"{key}_egress" for key in keys)}
    for key in ("fleet_whole_1", "fleet_whole_2", "fleet_stages_2"):
        assert report[key]["gbps"] > 0, key
        assert report[key]["read_bytes"] > 0, key
    assert report["fleet_whole_2"]["ratio"] > 0 and report["fleet_stages_2"]["ratio"] > 0
    assert report["fleet_whole_2"]["read_bytes"] == 2 * report["fleet_whole_1"]["read_bytes"]
    for key in ("fleet_whole_1_egress", "fleet_whole_2_egress", "fleet_stages_2_egress"):
        # Bytes, not time: the store sends the model once (and the headers the tier passes on)
        # however many nodes read it.
        assert 1.0 <= report[key]["model_copies"] <= 1.05, (key, report[key])
    assert [path.name for path in tmp_path.iterdir()] == ["bench.json"]  # its directory removed
    assert _nodes_of_dead_processes() == []  # its nodes too


def test_bench_signed_runs(fuse: None, tmp_path: Path) -> None:
    """--quick: 1/16 GiB of 8 MiB tensors in 2 shards, signed by files and by 1 MiB ranges, one try;
    its own SeaweedFS. Each figure means what it says: every side read the model's every tensor (or
    its first one), the same bytes, and each ratio is of two sides that did."""
    report = bench_quick("signed", tmp_path, timeout=900)
    assert report["notes"] == []
    rows = ("peer", "whole", "mount", "first")
    local = {
        f"signed_{flavor}_local_{row}" for flavor in ("files", "ranges") for row in (*rows, "warm", "mount_unsigned")
    }
    remote = {f"signed_{flavor}_s3_{row}" for flavor in ("files", "ranges") for row in rows}
    assert figures(report) == local | remote
    nbytes = report["signed_files_local_peer"]["nbytes"]
    assert nbytes >= 64 << 20
    whole = {report[key]["read"] for key in local | remote if not key.endswith("_first")}
    whole |= {report[key]["unsigned_read"] for key in local if key.endswith("_warm")}
    assert len(whole) == 1 and whole.pop().endswith(f"/{nbytes}")  # the model, every byte, each side
    firsts = {report[key][read] for key in local | remote if key.endswith("_first") for read in ("read", "peer_read")}
    assert len(firsts) == 1 and firsts.pop().endswith(f"/{8 << 20}")  # its first tensor, each side
    for where in ("local", "s3"):
        for flavor in ("files", "ranges"):
            key = f"signed_{flavor}_{where}"
            peer = seconds(report, f"{key}_peer")
            for row in ("whole", "mount"):
                divides(report, f"{key}_{row}", seconds(report, f"{key}_{row}"), peer)
            first = report[f"{key}_first"]
            divides(report, f"{key}_first", first["seconds"], first["peer_seconds"])
    for flavor in ("files", "ranges"):
        warm = report[f"signed_{flavor}_local_warm"]
        divides(report, f"signed_{flavor}_local_warm", warm["seconds"], warm["unsigned_seconds"])
        key = f"signed_{flavor}_local"
        divides(
            report, f"{key}_mount_unsigned", seconds(report, f"{key}_mount_unsigned"), seconds(report, f"{key}_peer")
        )
    assert (
        report["signed_ranges_local_first"]["at_most"] == 0.3 and report["signed_files_local_whole"]["at_most"] == 1.0
    )
    assert [path.name for path in tmp_path.iterdir()] == ["bench.json"]  # its directory removed


def test_bench_random_runs(fuse: None, tmp_path: Path) -> None:
    """--quick: a tensor of 1/16 GiB, 4 KiB and 1 MiB reads at random offsets, one try; each rate is of
    the reads made, each ratio of two rates measured, and what was read ahead against what was served."""
    report = bench_quick("random", tmp_path, timeout=300)
    assert report["notes"] == []  # nothing skipped (root, bindfs: CI has them)
    sides = ("_direct", "_bindfs", "_floor", "", "_ahead")
    assert figures(report) == {f"random_{key}{side}" for key in ("4k", "1m") for side in sides}
    for key in ("4k", "1m"):
        rate = {side: report[f"random_{key}{side}"].get("reads_per_second", 0.0) for side in sides[:4]}
        assert all(value > 0 for value in rate.values()), rate
        assert report[f"random_{key}_direct"]["reads"] >= 16
        for side in ("", "_floor"):
            assert report[f"random_{key}{side}"]["ratio"] == pytest.approx(rate[side] / rate["_bindfs"], abs=0.0011)
        ahead = report[f"random_{key}_ahead"]
        assert ahead["served_bytes"] > 0  # the mount served them (a page read twice is the kernel's the second time)
        assert ahead["ratio"] == pytest.approx(ahead["ahead_bytes"] / ahead["served_bytes"], abs=0.0011)
    assert [path.name for path in tmp_path.iterdir()] == ["bench.json"]  # its directory removed


def _nodes_of_dead_processes() -> list[str]:
    """Network namespaces of fleet nodes (tfs-PID-node-K) whose process is gone: left behind."""
    from tensorfs.mount.mounttable import pid_alive

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [name for name in names if (m := re.fullmatch(r"tfs-(\d+)-node-\d+", name)) and not pid_alive(int(m[1]))]


def test_bench_refuses_a_workdir_that_is_not_there(tmp_path: Path) -> None:
    """Before anything is built (it was a traceback from tempfile, once the model was being built)."""
    result = cli("bench", "--suite", "open", "--quick", "--workdir", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.endswith(
        f"Error: Invalid value for '--workdir': Directory '{tmp_path / 'nowhere'}' does not exist.\n"
    )
    assert result.stdout == ""


def test_bench_suites_and_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorfs import bench
    from tensorfs.cli import bench as command
    from tensorfs.cli import main

    assert command.SUITES == bench.SUITES == tuple(command.FIELDS)
    makefile = (ROOT / "Makefile").read_text()
    assert (
        tuple(re.findall(r"^\t\$\(PY\) -m tensorfs\.cli bench --suite (\w+)$", makefile, re.MULTILINE)) == bench.SUITES
    )
    # Refused before anything is built (--quick all the same: were one run, it would be short).
    for args, words in (
        (
            ["--suite", "open", "--gib", "1"],
            "--gib is for the suites read, remote, hash, load, formats, fleet, signed, random, not open",
        ),
        (
            ["--suite", "small", "--shards", "2"],
            "--shards is for the suites read, remote, open, hash, fleet, signed, not small",
        ),
        (["--tensors", "10"], "--tensors is for the suites open, hash, small, not read"),
        (["--nodes", "2"], "--nodes is for the suites fleet, not read"),
        (["--suite", "fleet", "--nodes", "0,2"], "each count of nodes is from 1 to 32"),
        (["--suite", "fleet", "--nodes", "two"], "is not a list of node counts like 1,2,4"),
        (["--suite", "open", "--tensors", "0"], "--tensors 0 only skips hash's model of tiny tensors"),
        (["--remote", "--suite", "hash"], "--remote is --suite remote: not --suite hash"),
    ):
        assert main(["bench", "--quick", *args]) == 2
        assert words in capsys.readouterr().err


def test_many_tiny_tensors_is_a_valid_model(tmp_path: Path) -> None:
    import tensorfs
    from tensorfs.testing.sample_models import many_tiny_tensors

    many_tiny_tensors(tmp_path, 1001, 4)
    with tensorfs.open_model(tmp_path) as model:
        assert len(model) == 1001
        assert len(model.shards) == 4


def test_the_demo_model_is_the_same_bytes_on_every_machine() -> None:
    """The demo's shards, as pinned here and in the README: their bytes come from no float math of the
    CPU's or of numpy's (a machine without AVX-512 made other bytes for the third shard when lm_head
    was cast from float64 and inv_freq was a float64 power)."""
    import importlib.util

    from tensorfs.testing.sample_models import shard_bytes

    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    digests = [hashlib.sha256(shard_bytes(shard)).hexdigest() for shard in demo.demo_shards()]
    assert digests == [
        "c867d790c661311aaafd2d4c890c1630a40cc0b2d15c40189e9ebbf36627e588",
        "3a0502c6e0e1cd994e5a9ba104cbfff5aad9977fad1499a1f992ee38ee38a1c0",
        "14877d1df7a714b8b289eda000c7ed947ba786801a4c267d77bed085b3821cbb",
    ]
    assert digests[2] in (ROOT / "README.md").read_text()


def test_demo_mounts_and_tours(fuse: None, tmp_path: Path) -> None:
    from conftest import wait_until
    from tensorfs.mount.mounttable import mount_at, pid_alive
    from tensorfs.mount.runtime import read_record

    mountpoint = tmp_path / "mnt"
    pid = None
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "demo.py"), str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "weight: OK" in result.stdout
        assert "memmap bfloat16 (8000, 512)" in result.stdout
        assert "21 tensors; [1. 1. 1. 1.]" in result.stdout  # the model directory view, by the reference reader
        lines = result.stdout.splitlines()
        digests = [
            line.split()[0]
            for line in lines
            if line.endswith("model/model-00003-of-00003.safetensors") and not line.startswith("$")
        ]
        assert len(digests) == 2 and digests[0] == digests[1]  # the source's file and the view's, byte for byte
        assert mount_at(mountpoint) is not None
        info = read_record(mountpoint)
        assert info is not None
        pid = int(str(info["pid"]))
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
        if pid is not None:
            wait_until(lambda: not pid_alive(pid), what="the demo daemon to exit", kill=pid)


def test_bench_quick_runs(fuse: None, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = cli("bench", "--quick", "--workdir", str(tmp_path), "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["notes"] == []  # nothing skipped (root, bindfs: CI has them)
    assert figures(report) == {
        "direct", "first_read", "reread", "memmap_sum", "memmap_sum_cached", "four_readers", "four_readers_direct",
        "cold_dd", "cold_first_read", "open_latency", "stat_latency", "page_cache", "page_cache_kept",
        "page_cache_reread", "rss_growth", "view_read", "metrics_read", "peer_first_read", "peer_first_read_bindfs",
        "peer_first_read_floor", "peer_memmap_sum", "peer_memmap_sum_bindfs", "peer_memmap_sum_floor",
        "tiny_mount", "tiny_remount", "tiny_first_mount", "tiny_mount_selected", "tiny_listing", "tiny_listing_split",
        "tiny_rss",
    }  # fmt: skip
    assert report["first_read"]["gbps"] > 0
    assert report["tiny_remount"]["seconds"] > 0 and report["tiny_first_mount"]["seconds"] > 0
    assert report["four_readers_direct"]["gbps"] > 0
    assert report["peer_first_read_floor"]["gbps"] > 0 and report["peer_memmap_sum_floor"]["seconds"] > 0
    # bindfs is installed by the bench when missing (as root, with apt-get); when that cannot be
    # done, the floor alone is measured, and the report says so: the test says it too, never silently.
    bindfs_note = [note for note in report["notes"] if note.startswith("bindfs peer skipped")]
    if shutil.which("bindfs"):
        assert not bindfs_note
        assert report["peer_first_read_bindfs"]["gbps"] > 0 and report["peer_memmap_sum_bindfs"]["seconds"] > 0
        assert "through bindfs" in result.stdout
    else:
        assert bindfs_note and "peer_first_read_bindfs" not in report
        warnings.warn(f"the bench measured only the pyfuse3 floor as a peer: {bindfs_note[0]}", stacklevel=1)
    # Every peer's connection was tuned as tensorfs tunes its own mounts.
    in_force = report["peer_first_read"]["in_force"]
    assert set(in_force) == {"tensorfs", "floor"} | ({"bindfs"} if shutil.which("bindfs") else set())
    assert all(knobs == in_force["tensorfs"] for knobs in in_force.values()), in_force
    growth = report["rss_growth"]["after_kib"] - report["rss_growth"]["before_kib"]
    assert growth < 5 * 1024  # the daemon's anonymous memory does not grow with the bytes it serves
    assert "first read through the mount" in result.stdout


def test_bench_remote_quick_runs(fuse: None, nginx: Nginx, tmp_path: Path) -> None:  # nginx: it is there
    out = tmp_path / "bench.json"
    command = ["bench", "--remote", "--quick", "--workdir", str(tmp_path), "--json", str(out)]
    result = cli(*command)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["notes"] == []  # nothing skipped (nginx is there)
    assert figures(report) == {
        "download", "download_cpu", "download_files", "link_download_files", "link_first_byte", "link_first_read",
        "link_arriving_reads",
        "local_first_read", "one_tensor", "remote_cpu", "remote_first_read", "remote_mount", "remote_mount_gets",
        "remote_open_latency", "remote_page_cache", "remote_reread", "remote_rss", "remote_stat_latency",
        "bucket_download", "bucket_s3fs", "bucket_rclone_off", "bucket_rclone_full", "bucket_tensorfs",
        "bucket_tensorfs_cpu", "bucket_s3fs_cpu", "bucket_rclone_off_cpu", "bucket_rclone_full_cpu",
        "bucket_tensorfs_switches",
    }  # fmt: skip
    assert report["remote_first_read"]["gbps"] > 0
    assert report["link_arriving_reads"]["reads"] > 0 and "reads answered from chunks still coming" in result.stdout
    assert report["one_tensor"]["bytes"] <= 2 * 8 * MIB  # reading one tensor fetched its own chunks alone
    assert "first read of a remote model through the mount" in result.stdout
    # The bucket: tensorfs's mount, s3fs and rclone's and a download, each read whole, each's CPU counted.
    for key in ("bucket_download", "bucket_s3fs", "bucket_rclone_off", "bucket_rclone_full", "bucket_tensorfs"):
        require("the bucket's peers (Debian's s3fs and rclone)", report[key].get("missing"))
        assert report[key]["gbps"] > 0 and report[key]["cpu_per_gib"] > 0 and report[key]["switches_per_gib"] > 0, key
    assert report["bucket_tensorfs_cpu"]["seconds"] > 0 and "s3fs-fuse" in result.stdout
    # Every byte read came in a FUSE read of the daemon's, of 1 MiB at most (the largest here: the kernel's
    # max_pages_limit is 256 pages, and libfuse 3.14 asks for no more); per GiB of the shard, whose
    # header is not read through the tensors' files.
    assert report["bucket_tensorfs"]["requests_per_gib"] > 1000


def test_soak_runs_briefly(fuse: None) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "3", "--threads", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 errors" in result.stdout
    killed = re.search(r"^  killed: (\d+)$", result.stdout, re.MULTILINE)  # readers killed once served, mid-read
    assert killed is not None and int(killed.group(1)) > 0, result.stdout


def test_make_clean_unmounts_the_demo_first(mounts: Mounts, tmp_path: Path) -> None:
    from tensorfs.testing.sample_models import many_tiny_tensors

    work = tmp_path / "checkout"
    (work / "demo" / "mnt").mkdir(parents=True)
    (work / ".venv").mkdir()
    many_tiny_tensors(work / "demo" / "model", 10, 1)
    mountpoint = mounts.mount(work / "demo" / "model", mountpoint=work / "demo" / "mnt")
    result = subprocess.run(
        ["make", "-f", str(ROOT / "Makefile"), "-C", str(work), "clean"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"unmounting {mountpoint}" in result.stdout
    assert not (work / "demo").exists() and not (work / ".venv").exists()


def test_every_package_is_in_the_distribution() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "tensorfs").rglob("__init__.py")}
    assert listed == found  # a package left out installs from a checkout (editable) but not from a wheel


def test_a_benchmarks_drop_of_the_page_cache_waits_for_the_tests_lock() -> None:
    """A benchmark run by a test drops the page cache only when no test holds the machine's lock (as a
    test measuring the page cache does): once they did it beside test_page_cache's exact counts."""
    require(f"writing {DROP_CACHES}", missing_drop_caches())
    code = "from tensorfs.bench.common import drop_caches; print('dropping', flush=True); drop_caches(); print('dropped', flush=True)"
    with machine_lock():
        bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert bench.stdout is not None
            pending = bytearray()
            assert read_line(bench.stdout.fileno(), 30, pending) == "dropping"
            wait_until(lambda: blocked_in(bench.pid, "flock"), what="the drop to wait for the lock")
        except BaseException:
            reap(bench)
            raise
    try:
        assert read_line(bench.stdout.fileno(), 30, pending) == "dropped"
        assert bench.wait(patience(30)) == 0
    finally:
        reap(bench)
