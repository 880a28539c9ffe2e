"""tensorfs.safe_open and load_file are drop-ins for safetensors': every argument their originals take,
in the same places, meaning the same (checked against the installed safetensors), a transformers
model loaded through them in safetensors' place, and numpy slices that take what safetensors'
take."""

from __future__ import annotations

import errno
import inspect
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
from helpers import as_bytes, fuzzing, random_bytes, same_tensor, write_reference

# What safetensors' docstrings give as the defaults its compiled signature shows as `...`.
DOCUMENTED_DEFAULTS = {"device": "cpu", "backend": "mmap"}


def same_parameters(ours: Callable[..., Any], theirs: Callable[..., Any]) -> None:
    """Every parameter of `theirs` is one of `ours`, in its place, of its kind and default; what
    `ours` has beyond them is keyword-only (tensorfs's own options)."""
    mine = list(inspect.signature(ours).parameters.values())
    reference = list(inspect.signature(theirs).parameters.values())
    assert [(p.name, p.kind) for p in mine[: len(reference)]] == [(p.name, p.kind) for p in reference]
    for ours_one, theirs_one in zip(mine, reference, strict=False):
        expected = theirs_one.default
        if expected is Ellipsis:
            expected = DOCUMENTED_DEFAULTS[theirs_one.name]
        assert ours_one.default == expected, ours_one.name
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in mine[len(reference) :]), mine


def test_the_signatures_are_safetensors(tmp_path: Path) -> None:
    same_parameters(tensorfs.safe_open, safetensors.safe_open)
    same_parameters(tensorfs.load_file, safetensors.torch.load_file)
    assert "backend" in inspect.signature(safetensors.safe_open).parameters  # the installed one is 0.8's

    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2, 3], random_bytes(24, 1)), "b": ("I64", [4], random_bytes(32, 2))})
    # Each call as safetensors takes it, positional or by keyword: the same tensors.
    for args, keywords in (
        ((path,), {}),
        ((path, "cpu"), {}),
        ((), {"filename": path, "device": "cpu", "backend": "mmap"}),
        ((path,), {"backend": "pread"}),
    ):
        expected = safetensors.torch.load_file(*args, **keywords)
        loaded = tensorfs.load_file(*args, **keywords)
        assert list(loaded) == list(expected)
        for name, tensor in expected.items():
            same_tensor(loaded[name], tensor)
    for args, keywords in (
        ((path, "pt"), {}),
        ((path, "np", "cpu"), {}),
        ((), {"filename": path, "framework": "pt", "device": "cpu", "backend": "pread"}),
    ):
        with tensorfs.safe_open(*args, **keywords) as ours, safetensors.safe_open(*args, **keywords) as theirs:
            for name in theirs.offset_keys():
                same_tensor(ours.get_tensor(name), theirs.get_tensor(name))
    with pytest.raises(TypeError):  # the framework is required, as safetensors requires it
        tensorfs.safe_open(path)  # type: ignore[call-arg]


def test_load_file_takes_the_device_second_and_says_so_to_who_meant_the_framework(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2], random_bytes(8, 1))})
    assert isinstance(tensorfs.load_file(path, "cpu")["w"], torch.Tensor)
    assert isinstance(tensorfs.load_file(path, framework="np")["w"], np.ndarray)  # numpy: tensorfs's own option
    for framework in ("np", "numpy", "pt"):
        with pytest.raises(tensorfs.TensorfsError) as raised:
            tensorfs.load_file(path, framework)
        message = str(raised.value)
        assert "second argument is the device" in message and f"framework={framework!r}" in message, message
        assert "\n" not in message
    with pytest.raises(safetensors.SafetensorError, match="device gpu0 is invalid: torch does not know it"):
        tensorfs.load_file(path, "gpu0")
    for call in (tensorfs.load_file, lambda path, **kw: tensorfs.safe_open(path, "pt", **kw)):
        with pytest.raises(tensorfs.TensorfsError, match="backend 'uring' is invalid: 'mmap' or 'pread'"):
            call(path, backend="uring")
    with pytest.raises(safetensors.SafetensorError, match="invalid"):  # as safetensors refuses it
        safetensors.safe_open(str(path), "pt", backend="uring")


def mappings_of(path: Path) -> list[tuple[int, int]]:
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            found.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return found  # type: ignore[return-value]


def test_backend_pread_reads_tensors_into_memory_of_their_own(tmp_path: Path) -> None:
    """As safetensors' "pread": each tensor's bytes read from the file, on no mapping of it; with
    "mmap" (the default) on the shard's mapping."""
    path = tmp_path / "m.safetensors"
    data = random_bytes(1 << 20, 3)
    write_reference(path, {"big": ("U8", [1024, 1024], data), "s": ("I16", [], b"4\x12")})

    def on_the_file(address: int) -> bool:
        return any(low <= address < high for low, high in mappings_of(path))

    with tensorfs.safe_open(path, "pt", backend="pread") as opened:
        big = opened.get_tensor("big")
        assert as_bytes(big) == data and not on_the_file(big.data_ptr())
        row = opened.get_slice("big")[5]
        assert as_bytes(row) == data[5 * 1024 : 6 * 1024] and not on_the_file(row.data_ptr())
        assert row.untyped_storage().nbytes() == 1024  # its own bytes, not the whole tensor's held
        big[0, 0] = 7  # writable
    with tensorfs.safe_open(path, "np", backend="pread") as opened:
        array = opened.get_tensor("big")
        assert array.tobytes() == data and not on_the_file(array.ctypes.data)
        element = opened.get_slice("s")[()]
        assert element.shape == () and element.tobytes() == b"4\x12"
    with tensorfs.safe_open(path, "pt") as opened:
        assert on_the_file(opened.get_tensor("big").data_ptr())  # mmap: on the file's mapping
    state = tensorfs.load_file(path, backend="pread")
    assert as_bytes(state["big"]) == data and not on_the_file(state["big"].data_ptr())
    assert path.read_bytes().count(data) == 1  # no write reached the file


# A tiny Llama written by transformers itself, loaded with transformers' own safe_open replaced.
def test_transformers_loads_a_model_through_tensorfs_safe_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=96,
    )
    directory = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(directory)
    expected = AutoModelForCausalLM.from_pretrained(directory).eval()

    calls: list[dict[str, Any]] = []

    def recorded(*args: Any, **keywords: Any) -> tensorfs.SafeOpen:
        calls.append(dict(zip(("filename", "framework", "device"), args, strict=False)) | keywords)
        return tensorfs.safe_open(*args, **keywords)

    for module in ("transformers.modeling_utils", "transformers.modeling_layers"):  # where transformers imports it
        if hasattr(sys.modules.get(module), "safe_open"):
            monkeypatch.setattr(f"{module}.safe_open", recorded)
    assert transformers.modeling_utils.safe_open is recorded
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert calls and all(Path(call["filename"]).parent == directory for call in calls)
    assert any("backend" in call for call in calls)  # transformers 5 passes it
    ours, theirs = loaded.state_dict(), expected.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


# -- slices ---------------------------------------------------------------------------------------

SHAPES = [(), (0,), (1,), (5,), (0, 4), (3, 4), (2, 0, 3), (2, 3, 4)]


@pytest.fixture(scope="module")
def sliced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("slices") / "m.safetensors"
    tensors = {}
    for i, shape in enumerate(SHAPES):
        count = int(np.prod(shape)) if shape else 1
        tensors[f"t{i}"] = ("I16", list(shape), random_bytes(2 * count, i))
    write_reference(path, tensors)
    return path


bounds = st.none() | st.integers(-7, 7) | st.sampled_from([True, False, np.int64(2), 2**70, 1.0])
index_items = st.one_of(
    st.integers(-7, 7),
    st.builds(slice, bounds, bounds, st.none() | st.integers(-2, 3) | st.just(np.int32(2))),
    st.just(Ellipsis),
    st.sampled_from([None, True, False, np.True_, np.int64(1), np.array(1), np.array([1]), 1.5, "a", 2**70, [0], ()]),
)
keys = index_items | st.lists(index_items, max_size=4).map(tuple) | st.sampled_from([[], [0, 1], [slice(None)]])


def taken(slicer: Any, key: Any) -> tuple[str, Any]:
    try:
        return "taken", slicer[key]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # safetensors' Rust panics too ([1:0:2]): a PanicException is no Exception
        return "refused", exc


@fuzzing(150)
@given(st.integers(0, len(SHAPES) - 1), keys)
def test_numpy_slices_take_what_safetensors_takes_and_torch_slices_are_torchs(
    sliced: Path, which: int, key: Any
) -> None:
    """Differential: a key safetensors' get_slice takes gives the same dtype, shape and bytes; one it
    refuses, tensorfs refuses too (numpy: a tensorfs.SliceError, also an IndexError, naming the
    file, the tensor and why; torch: torch's own error, as safetensors' torch slices raise)."""
    name = f"t{which}"
    for framework in ("np", "pt"):
        with (
            tensorfs.safe_open(sliced, framework, cache=False) as ours,
            safetensors.safe_open(str(sliced), framework) as theirs,
        ):
            their_way, expected = taken(theirs.get_slice(name), key)
            our_way, got = taken(ours.get_slice(name), key)
            assert our_way == their_way, (framework, SHAPES[which], key, expected, got)
            if our_way == "taken":
                same_tensor(got, expected)
            elif framework == "np":
                assert isinstance(got, tensorfs.SliceError) and isinstance(got, IndexError), got
                message = str(got)
                ours = f"{sliced}: tensor '{name}': slice ["
                if isinstance(expected, safetensors.SafetensorError):  # its words first: code matches on them
                    assert message.startswith(f"{expected} ({ours}"), (key, message, expected)
                else:  # (an OverflowError, a TypeError, a panic: nothing of its own to say)
                    assert message.startswith(ours), (key, message, expected)
                assert "\n" not in message
            else:
                assert type(got) is type(expected), (got, expected)


def test_numpy_slices_where_safetensors_differs_from_numpy(sliced: Path) -> None:
    """The cases numpy alone would answer otherwise: True is 1 (numpy: a new axis), a slice past the
    end or of a negative bound is refused (numpy clips it), None and lists are refused."""
    with tensorfs.safe_open(sliced, "np") as ours, safetensors.safe_open(str(sliced), "np") as theirs:
        name = f"t{SHAPES.index((3, 4))}"
        assert ours.get_slice(name)[True].shape == theirs.get_slice(name)[True].shape == (4,)
        same_tensor(ours.get_slice(name)[[]], theirs.get_slice(name)[[]])  # [] is [0:0]
        for key in (slice(1, 9), slice(-2, None), slice(3, None), None, [0, 1], slice(None, None, -1)):
            with pytest.raises(tensorfs.SliceError):
                ours.get_slice(name)[key]
            with pytest.raises(Exception):  # noqa: B017 (SafetensorError, OverflowError: whatever it raises)
                theirs.get_slice(name)[key]


DROP_IN_TENSORS = {
    "w": ("F32", [2, 3], random_bytes(24, 3)),
    "h": ("F16", [5], random_bytes(10, 4)),
    "i": ("I64", [1, 2], random_bytes(16, 5)),
    "flags": ("BOOL", [3], bytes([1, 0, 1])),
    "scalar": ("U8", [], b"\x07"),
    "empty": ("F32", [0, 4], b""),
}


def test_the_drop_in_modules_read_as_safetensors_modules_do(tmp_path: Path) -> None:
    """tensorfs.torch and tensorfs.numpy: load (of bytes), load_file and safe_open take what
    safetensors.torch and safetensors.numpy take, and give the same tensors of the same bytes."""
    import safetensors.numpy

    import tensorfs.numpy
    import tensorfs.torch

    path = tmp_path / "m.safetensors"
    write_reference(path, DROP_IN_TENSORS)
    data = path.read_bytes()
    for ours, theirs in ((tensorfs.torch, safetensors.torch), (tensorfs.numpy, safetensors.numpy)):
        same_parameters(ours.load, theirs.load)
        same_parameters(ours.load_file, theirs.load_file)
        assert ours.safe_open is tensorfs.safe_open and theirs.safe_open is safetensors.safe_open
        for loaded, expected in ((ours.load(data), theirs.load(data)), (ours.load_file(path), theirs.load_file(path))):
            assert sorted(loaded) == sorted(expected) == sorted(DROP_IN_TENSORS)
            for name, tensor in expected.items():
                same_tensor(loaded[name], tensor)
    loaded = tensorfs.torch.load(bytearray(data))  # bytes of its own: neither the caller's nor read-only
    loaded["w"] += 1
    assert tensorfs.torch.load(data)["w"].add(1).equal(loaded["w"]) and path.read_bytes() == data


def bad_files(good: bytes) -> dict[str, bytes]:
    """Files safetensors refuses, each made from the good one's bytes."""
    length = int.from_bytes(good[:8], "little")
    header = good[8 : 8 + length]
    return {
        "too short": good[:5],
        "cut in its data": good[:-1],
        "a byte too many": good + b"\0",
        "a header past the end": (len(good)).to_bytes(8, "little") + good[8:],
        "no JSON": length.to_bytes(8, "little") + b"!" * length + good[8 + length :],
        "a dtype unknown": good.replace(b'"F32"', b'"F99"', 1),
        "overlapping": good.replace(header, header.replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1), 1),
    }


def test_a_file_safetensors_refuses_is_a_safetensor_error_from_tensorfs(tmp_path: Path) -> None:
    """Code written for safetensors catches its SafetensorError: tensorfs's refusal of the same file
    (its load, load_file, safe_open), of a tensor not there and of a slice safetensors does not take
    is one too, and still a TensorfsError (and a KeyError, an IndexError, as each was)."""
    import safetensors.numpy

    import tensorfs.numpy
    import tensorfs.torch

    good = tmp_path / "good.safetensors"
    write_reference(good, {"w": ("F32", [2, 2], random_bytes(16, 6)), "v": ("F32", [2], random_bytes(8, 7))})
    for why, data in bad_files(good.read_bytes()).items():
        path = tmp_path / f"{why}.safetensors"
        path.write_bytes(data)
        with pytest.raises(safetensors.SafetensorError):
            safetensors.numpy.load(data)  # the reference refuses it: so must tensorfs, with its error
        reads: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
            (tensorfs.torch.load, (data,)),
            (tensorfs.numpy.load, (data,)),
            (tensorfs.load_file, (path,)),
            (tensorfs.numpy.load_file, (path,)),
            (tensorfs.safe_open, (path, "np")),
        ]
        for read, arguments in reads:
            with pytest.raises(safetensors.SafetensorError) as raised:
                read(*arguments)
            assert isinstance(raised.value, tensorfs.InvalidModelError), why
    with tensorfs.safe_open(good, "np") as opened:
        with pytest.raises(safetensors.SafetensorError) as missing:
            opened.get_tensor("nothing")
        assert isinstance(missing.value, KeyError)
        with pytest.raises(safetensors.SafetensorError) as sliced:
            opened.get_slice("w")[None]
        assert isinstance(sliced.value, IndexError)


def test_a_closed_handle_raises_what_safetensors_raises(tmp_path: Path) -> None:
    """Every call on a handle used after its `with` block raises a SafetensorError, as safetensors'
    does ("File is closed"): keys() answered, and the others raised an error no SafetensorError."""
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2, 3], random_bytes(24, 1))})
    calls: dict[str, Callable[[Any], Any]] = {
        "keys": lambda f: f.keys(),
        "offset_keys": lambda f: f.offset_keys(),
        "metadata": lambda f: f.metadata(),
        "get_tensor": lambda f: f.get_tensor("w"),
        "get_slice": lambda f: f.get_slice("w"),
    }
    for framework in ("np", "pt"):
        with tensorfs.safe_open(path, framework) as ours, safetensors.safe_open(str(path), framework) as theirs:
            sliced = ours.get_slice("w")
        for name, call in calls.items():
            with pytest.raises(safetensors.SafetensorError, match=r"^File is closed"):
                call(theirs)
            with pytest.raises(
                safetensors.SafetensorError, match="^" + re.escape(f"File is closed: model {path} was closed")
            ) as raised:
                call(ours)
            assert isinstance(raised.value, tensorfs.ModelClosedError), name
        with pytest.raises(safetensors.SafetensorError, match=r"^File is closed"):
            ours.get_tensors()
        with pytest.raises(safetensors.SafetensorError, match=r"^File is closed"):
            sliced[0]
        again = pickle.loads(pickle.dumps(raised.value))
        assert (type(again), str(again)) == (tensorfs.ModelClosedError, str(raised.value))


def test_a_framework_or_a_device_safetensors_refuses_is_a_safetensor_error(tmp_path: Path) -> None:
    """An unknown framework or device is a SafetensorError from tensorfs, as from safetensors (it
    was a plain TensorfsError), in its words, then why; from safe_open, load_file and the model."""
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2, 3], random_bytes(24, 1))})
    refused: list[tuple[Callable[[], Any], Callable[[], Any], str]] = [
        (
            lambda: safetensors.safe_open(str(path), "jax2"),
            lambda: tensorfs.safe_open(path, "jax2"),
            "framework jax2 is invalid",
        ),
        (
            lambda: safetensors.safe_open(str(path), "pt", device="tpu9"),
            lambda: tensorfs.safe_open(path, "pt", device="tpu9"),
            "device tpu9 is invalid",
        ),
        (
            lambda: safetensors.safe_open(str(path), "np", device="cuda:0"),
            lambda: tensorfs.safe_open(path, "np", device="cuda:0"),
            "Device cuda:0 is not supported for framework numpy",
        ),
        (
            lambda: safetensors.torch.load_file(path, device="tpu9"),
            lambda: tensorfs.load_file(path, device="tpu9"),
            "device tpu9 is invalid",
        ),
        (
            lambda: safetensors.torch.load_file(path, "np"),
            lambda: tensorfs.load_file(path, "np"),
            "device np is invalid",
        ),
        (
            lambda: safetensors.safe_open(str(path), "pt", backend="uring"),
            lambda: tensorfs.safe_open(path, "pt", backend="uring"),
            "backend 'uring' is invalid",
        ),
    ]
    for theirs, ours, said in refused:
        with pytest.raises(safetensors.SafetensorError):
            theirs()
        with pytest.raises(safetensors.SafetensorError, match="^" + re.escape(said)) as raised:
            ours()
        assert isinstance(raised.value, tensorfs.TensorfsError) and "\n" not in str(raised.value)
    with tensorfs.open_model(path) as model, pytest.raises(safetensors.SafetensorError, match=r"^framework tf is"):
        model.tensor("w", "tf")
    with pytest.raises(safetensors.SafetensorError, match=r"^framework jax2 is invalid"):
        tensorfs.load_file(path, framework="jax2")


def test_a_refused_slice_is_said_in_safetensors_words_then_tensorfs(tmp_path: Path) -> None:
    """Code written for safetensors matches on its words for a refused numpy slice: tensorfs says
    them first, then the file, the tensor, the slice as written (a list as a list: [0, 1], not
    [[0, 1]]) and why. The differential test above holds every key to this; these are the kinds."""
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [3, 4], random_bytes(48, 1))})
    keys: list[tuple[Any, str]] = [
        ([0, 1], "[0, 1]"),
        ((0, None), "[0, None]"),
        ((slice(0, 2, -1),), "[0:2:-1]"),
        ((Ellipsis, Ellipsis), "[..., ...]"),
        ((-5,), "[-5]"),
        ((0, 0, 0), "[0, 0, 0]"),
        ((Ellipsis, 9), "[..., 9]"),
        ((slice(1, 10), 0), "[1:10, 0]"),
    ]
    with tensorfs.safe_open(path, "np") as ours, safetensors.safe_open(str(path), "np") as theirs:
        for key, written in keys:
            with pytest.raises(safetensors.SafetensorError) as expected:
                theirs.get_slice("w")[key]
            with pytest.raises(tensorfs.SliceError) as raised:
                ours.get_slice("w")[key]
            message = str(raised.value)
            assert message.startswith(f"{expected.value} ({path}: tensor 'w': slice {written}: "), message
        assert (
            str(expected.value)
            == "Error during slicing [1:10, 0] with shape [3, 4]: index 9 out of bounds for tensor dimension #0 of size 3"
        )


def test_a_file_not_there_is_a_file_not_found_error_as_from_safetensors(tmp_path: Path) -> None:
    """Code written for safetensors catches FileNotFoundError for a file that is not there: tensorfs's
    refusal of it is one too (its errno and filename), still an InvalidModelError, its message
    safetensors' (code matches on it), and the same error again once pickled (as a worker process
    hands it on)."""
    import safetensors.numpy

    import tensorfs.numpy
    import tensorfs.torch

    path = tmp_path / "not-there.safetensors"
    with pytest.raises(FileNotFoundError):
        safetensors.numpy.load_file(path)
    reads: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (tensorfs.load_file, (path,)),
        (tensorfs.numpy.load_file, (path,)),
        (tensorfs.torch.load_file, (path,)),
        (tensorfs.safe_open, (path, "np")),
        (tensorfs.open_model, (tmp_path / "no-folder",)),
    ]
    for read, arguments in reads:
        with pytest.raises(FileNotFoundError) as raised:
            read(*arguments)
        error = raised.value
        assert isinstance(error, tensorfs.ModelNotFound) and isinstance(error, tensorfs.InvalidModelError)
        assert (error.errno, error.filename) == (errno.ENOENT, str(arguments[0]))
        assert str(error) == f"No such file or directory: {arguments[0]}"  # safetensors' words
        assert error.lines() == [f"{arguments[0]}: no such file or directory"]  # the CLI's: the file first
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), again.errno) == (tensorfs.ModelNotFound, str(error), errno.ENOENT)


def test_without_safetensors_the_errors_are_tensorfs_own(tmp_path: Path) -> None:
    """safetensors is optional: without it, tensorfs imports and refuses a file with its own error."""
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"short")
    script = (
        "import sys; sys.modules['safetensors'] = None\n"  # an import of it fails, as when not installed
        "import tensorfs\n"
        f"try:\n    tensorfs.open_model({str(path)!r})\n"
        "except tensorfs.InvalidModelError as exc:\n    print(type(exc).__mro__[2].__module__, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout == f"tensorfs.errors {path}: file is 5 bytes, too short to hold the 8-byte header length\n"
