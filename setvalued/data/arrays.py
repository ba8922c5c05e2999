"""A researcher's own NumPy arrays: ``x`` (inputs) and ``y`` (labels 0..L-1) in ``.npz`` files.

``data.root`` is one ``.npz`` file, or a folder holding ``train.npz`` and optionally ``val.npz``
and ``test.npz``; a missing ``val`` or ``test`` is held out of the training arrays,
``val_fraction`` / ``test_fraction`` of every class, seeded by ``split_seed``
(``common.held_out_parts``, as image_folder).

- ``x`` (N, D): vectors, for the MLP. ``x`` (N, H, W): one-channel images. ``x`` (N, C, H, W) or
  (N, H, W, C) (``layout``; auto: the axis of size 1 or 3): images, for the CNNs, served as
  (N, C, H, W). uint8 inputs are pixels (divided by 255); other integer and float inputs are
  taken as they are; with ``normalize`` every channel (images) or feature (vectors) is then
  standardised with the mean and std of the training split.
- ``y`` (N,): integer labels; L is ``num_classes``, or the largest training label + 1.
- The splits are in-memory tensors without a per-example transform, so
  ``data.placement: device`` holds them on the training device as CIFAR's
  (``setvalued.data.device``); no augmentation.

Trust bounds (docs/read-back.md): the file is a regular file; its zip directory, read from the
end record before ``zipfile`` parses it, lists at most ``MAX_MEMBERS`` members in at most
``MAX_DIRECTORY_BYTES``; the members ``x.npy`` and ``y.npy`` declare at most ``MAX_ARRAY_BYTES``
uncompressed, and their ``.npy`` headers a numeric dtype and a shape whose size fits the
declared length, all checked before any data is read; the data are read with
``allow_pickle=False`` (an object array, which only a pickle can hold, is refused by name).
"""

from __future__ import annotations

import math
import os
import stat
import struct
import zipfile
from typing import Any, cast

import numpy as np
import torch

from setvalued.data.common import (
    DataLayoutError,
    DataSplits,
    TensorSplit,
    channel_statistics,
    counts_of,
    declared_settings,
    held_out_parts,
    layout_error,
    standardized,
)

SPLITS = ("train", "val", "test")
EXPECTED_LAYOUT = (
    "ROOT.npz, or ROOT/train.npz with optional ROOT/val.npz and ROOT/test.npz, each "
    "written by numpy.savez(_compressed) with x: (N, D), (N, H, W), (N, C, H, W) or "
    "(N, H, W, C) numbers and y: (N,) integer labels 0..L-1"
)
MEMBERS = ("x", "y")
#: bounds on what is read (docs/read-back.md)
MAX_MEMBERS = 64
MAX_DIRECTORY_BYTES = 2**20
MAX_ARRAY_BYTES = 16 * 2**30
_END_RECORD = b"PK\x05\x06"
_ZIP64_LOCATOR, _ZIP64_END_RECORD = b"PK\x06\x07", b"PK\x06\x06"
#: the most classes an arrays set may have (labels are counted per class)
MAX_CLASSES = 1_000_000
_SPLIT_STREAM = 0x4E505A  # "NPZ": the held-out splits' permutation stream


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The arrays fields of a data config, checked against their declarations."""
    return declared_settings("arrays", cfg)


def find_files(root: Any) -> dict[str, str]:
    """Split -> .npz path: the file ``root`` (as train), or the files of the folder ``root``."""
    if root is None:
        raise layout_error("<data.root not set>", "data.root is required for arrays", EXPECTED_LAYOUT)
    root = os.fspath(root)
    if os.path.isdir(root):
        files = {s: os.path.join(root, f"{s}.npz") for s in SPLITS if os.path.exists(os.path.join(root, f"{s}.npz"))}
        if "train" not in files:
            raise layout_error(os.path.join(root, "train.npz"), "no training arrays", EXPECTED_LAYOUT)
        return files
    if not os.path.exists(root):
        raise layout_error(root, "arrays file does not exist", EXPECTED_LAYOUT)
    if not root.endswith(".npz"):
        raise layout_error(root, "not a .npz file", EXPECTED_LAYOUT)
    return {"train": root}


def _check_directory(path: str, size: int) -> None:
    """The zip end record's member count and directory size, read before ``zipfile`` builds its
    directory (a crafted file with millions of members would fill memory there)."""
    tail = min(size, 22 + 65535)
    with open(path, "rb") as f:
        f.seek(size - tail)
        end = f.read(tail)
    at = end.rfind(_END_RECORD)
    if at < 0 or len(end) - at < 22:
        raise DataLayoutError(f"arrays file {path!r} is not a .npz (zip) file: no end record")
    count, directory = struct.unpack("<HI", end[at + 10 : at + 16])
    locator = end[at - 20 : at] if at >= 20 else b""
    if locator[:4] == _ZIP64_LOCATOR:  # zipfile then reads the counts of the zip64 end record
        (offset,) = struct.unpack("<Q", locator[8:16])
        with open(path, "rb") as f:
            f.seek(min(offset, size))
            record = f.read(56)
        if len(record) < 56 or record[:4] != _ZIP64_END_RECORD:
            raise DataLayoutError(f"arrays file {path!r} has a broken zip64 end record")
        count, directory = struct.unpack("<QQ", record[32:48])
    if count > MAX_MEMBERS or directory > MAX_DIRECTORY_BYTES:
        raise DataLayoutError(
            f"arrays file {path!r} lists {count} members in {directory:,} bytes; at most "
            f"{MAX_MEMBERS} in {MAX_DIRECTORY_BYTES:,} (docs/read-back.md)"
        )


def _header(archive: zipfile.ZipFile, path: str, member: str) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape of ``member``.npy from its declared size and .npy header (no data read)."""
    name = f"{member}.npy"
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise DataLayoutError(
            f"arrays file {path!r} has no array {member!r} (it has "
            f"{sorted(n.removesuffix('.npy') for n in archive.namelist())}). "
            f"Expected layout: {EXPECTED_LAYOUT}"
        ) from None
    if info.file_size > MAX_ARRAY_BYTES:
        raise DataLayoutError(
            f"array {member!r} of {path!r} declares {info.file_size:,} bytes, more than the "
            f"{MAX_ARRAY_BYTES:,} of docs/read-back.md"
        )
    try:
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            header_bytes = f.tell() if f.seekable() else 0
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as err:
        raise DataLayoutError(f"array {member!r} of {path!r} is not a .npy array: {err}") from None
    if dtype.hasobject:
        raise DataLayoutError(
            f"array {member!r} of {path!r} is an object array (dtype {dtype}): it could "
            "only be read by unpickling, which is refused"
        )
    numeric = "uif"  # a float y is refused once read, naming a NaN label if it holds one (_float_labels)
    if dtype.kind not in numeric:
        raise DataLayoutError(
            f"array {member!r} of {path!r} has dtype {dtype}; expected "
            f"{'numbers (integer or float)' if member == 'x' else 'integer labels'}"
        )
    if math.prod(shape) * dtype.itemsize > info.file_size - header_bytes:
        raise DataLayoutError(
            f"array {member!r} of {path!r} declares shape {shape} of {dtype}, more than its {info.file_size:,} bytes"
        )
    return dtype, tuple(int(s) for s in shape)


def read_npz(path: str, load_x: bool = True) -> tuple[np.ndarray | tuple[int, ...], np.ndarray]:
    """(x, y) of one .npz file, or (x's shape, y) with ``load_x`` false, within the bounds above."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise DataLayoutError(f"cannot read arrays file {path!r}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataLayoutError(f"arrays file {path!r} is not a regular file")
    if info.st_size == 0:
        raise DataLayoutError(f"arrays file {path!r} is empty (0 bytes)")
    _check_directory(path, info.st_size)
    try:
        with zipfile.ZipFile(path) as archive:
            shapes = {m: _header(archive, path, m)[1] for m in MEMBERS}
            check_shapes(path, shapes["x"], shapes["y"])
            out = {}
            for member in MEMBERS if load_x else ("y",):
                with archive.open(f"{member}.npy") as f:
                    out[member] = np.lib.format.read_array(f, allow_pickle=False)
            _float_labels(path, out["y"])
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as err:
        if isinstance(err, DataLayoutError):
            raise
        raise DataLayoutError(f"cannot read arrays file {path!r}: {err}") from None
    return (out["x"] if load_x else shapes["x"]), out["y"]


def _float_labels(path: str, y: np.ndarray) -> None:
    """Refuse labels that are not integers, naming the first NaN or infinite one if any."""
    if y.dtype.kind in "ui":
        return
    bad = np.flatnonzero(~np.isfinite(y))
    where = f" and a NaN or infinite label at example {int(bad[0])}" if len(bad) else ""
    raise DataLayoutError(f"array 'y' of {path!r} has dtype {y.dtype}{where}; expected integer labels 0..L-1")


#: bytes of x scanned at a time for NaN and infinity (the preflight holds no more of it)
_SCAN_BYTES = 16 * 2**20
#: the kind under which the file-digest cache remembers a file whose x is finite
_FINITE_KIND = "arrays-x-finite-v1"


def first_non_finite(path: str) -> tuple[int, ...] | None:
    """The index in ``x`` of the first NaN or infinite value of the .npz file (the smallest
    example holding one), None when every value is finite (integer ``x`` always is); read a
    chunk at a time, after `read_npz`'s checks of the file."""
    with zipfile.ZipFile(path) as archive:
        dtype, shape = _header(archive, path, "x")
        if dtype.kind != "f":
            return None
        with archive.open("x.npy") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            _, fortran, _ = header(f)
            count, first = max(1, _SCAN_BYTES // dtype.itemsize), None
            offset = 0
            while raw := f.read(count * dtype.itemsize):
                chunk = np.frombuffer(raw[: len(raw) - len(raw) % dtype.itemsize], dtype=dtype)
                bad = np.flatnonzero(~np.isfinite(chunk))
                if len(bad):
                    found = np.unravel_index(offset + bad, shape, order="F" if fortran else "C")
                    at = int(np.argmin(found[0]))
                    index = tuple(int(axis[at]) for axis in found)
                    if first is None or index[0] < first[0]:
                        first = index
                    if not fortran:  # in C order the first found is the first example's
                        return first
                offset += len(chunk)
    return first


def _finite_fact(path: str) -> str:
    """``finite``, or DataLayoutError naming the file, the array and the first index."""
    index = first_non_finite(path)
    if index is not None:
        raise DataLayoutError(
            f"array 'x' of {path!r} has a NaN or infinite value at example {index[0]} "
            f"(x[{', '.join(map(str, index))}]); expected finite numbers"
        )
    return "finite"


def check_finite(files: dict[str, str]) -> None:
    """Every file's ``x`` holds finite numbers (DataLayoutError naming the first that does not);
    a file found finite before, unchanged since, is not read again (the file-digest cache)."""
    from setvalued.provenance.file_digests import DigestCache

    DigestCache().digests(list(files.values()), kind=_FINITE_KIND, digester=_finite_fact)


def check_shapes(path: str, x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> None:
    if len(y_shape) != 1:
        raise DataLayoutError(f"array 'y' of {path!r} has shape {y_shape}; expected (N,) labels")
    if len(x_shape) not in (2, 3, 4):
        raise DataLayoutError(
            f"array 'x' of {path!r} has shape {x_shape}; expected (N, D), (N, H, W), (N, C, H, W) or (N, H, W, C)"
        )
    if x_shape[0] != y_shape[0]:
        raise DataLayoutError(
            f"arrays file {path!r} has {x_shape[0]} inputs x but {y_shape[0]} labels y (lengths differ)"
        )
    if x_shape[0] == 0:
        raise DataLayoutError(f"arrays file {path!r} holds no examples")


def channels_first(path: str, shape: tuple[int, ...], layout: str) -> bool | None:
    """Whether 4-d ``x`` is (N, C, H, W) (True) or (N, H, W, C) (False); None for other ranks."""
    if len(shape) != 4:
        return None
    if layout != "auto":
        return layout == "nchw"
    first, last = shape[1] in (1, 3), shape[3] in (1, 3)
    if first != last:
        return first
    raise DataLayoutError(
        f"array 'x' of {path!r} has shape {shape}: set data.layout to nchw or nhwc "
        "(auto looks for one axis of size 1 or 3)"
    )


def example_shape(path: str, shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape of one example as the model sees it: (D,) or (C, H, W)."""
    first = channels_first(path, shape, layout)
    if len(shape) == 3:
        return (1, shape[1], shape[2])
    if first is None:
        return tuple(shape[1:])
    return tuple(shape[1:]) if first else (shape[3], shape[1], shape[2])


def _labels(files: dict[str, str], ys: dict[str, np.ndarray], num_classes: int | None) -> int:
    """L, after checking every split's labels against 0..L-1 (naming the file and example)."""
    L = num_classes if num_classes is not None else int(ys["train"].max()) + 1
    if L > MAX_CLASSES:
        raise DataLayoutError(
            f"array 'y' of {files['train']!r} implies {L:,} classes, more than the {MAX_CLASSES:,} of docs/read-back.md"
        )
    for split, y in ys.items():
        bad = np.flatnonzero((y < 0) | (y >= L))
        if len(bad):
            where = "data.num_classes" if num_classes is not None else "the largest training label + 1"
            raise DataLayoutError(
                f"array 'y' of {files[split]!r} has label {int(y[bad[0]])} at example "
                f"{int(bad[0])}, outside 0..{L - 1} (L = {L}: {where})"
            )
    if L < 2:
        raise DataLayoutError(f"array 'y' of {files['train']!r} has one class only; expected labels 0..L-1, L >= 2")
    return L


def check_layout(cfg: dict[str, Any]) -> None:
    """The preflight: every file's bounds, headers, lengths and labels, then x's values, a chunk
    at a time, for NaN and infinity (once per version of a file: `check_finite`)."""
    v = settings(cfg)
    files = find_files(v["root"])
    shapes: dict[str, tuple[int, ...]] = {}
    ys = {}
    for split, path in files.items():
        shape, ys[split] = read_npz(path, load_x=False)
        shapes[split] = cast(tuple[int, ...], shape)  # load_x=False: the shape, not the array
        example_shape(path, shapes[split], v["layout"])
    _same_example_shape(files, {s: example_shape(files[s], shape, v["layout"]) for s, shape in shapes.items()})
    check_finite(files)
    _labels(files, ys, v["num_classes"])
    _held_out(files, ys["train"], v)


def _same_example_shape(files: dict[str, str], per_split: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The one example shape of every split (naming a file whose examples differ from train's)."""
    for split, shape in per_split.items():
        if shape != per_split["train"]:
            raise DataLayoutError(
                f"array 'x' of {files[split]!r} holds examples of shape {shape}, but "
                f"{files['train']!r} of shape {per_split['train']}"
            )
    return per_split["train"]


def _held_out(files: dict[str, str], y_train: np.ndarray, v: dict[str, Any]) -> dict[str, np.ndarray]:
    return held_out_parts(
        y_train,
        files,
        v,
        _SPLIT_STREAM,
        lambda split, fraction: DataLayoutError(
            f"data.{split}_fraction={fraction} holds out no example of {files['train']!r} (too few per "
            f"class); add {split}.npz or raise it"
        ),
    )


def _as_inputs(path: str, x: np.ndarray, layout: str) -> torch.Tensor:
    """x as a tensor (n, D) or (n, C, H, W); uint8 stays uint8 (pixels), the rest float32."""
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])
        raise DataLayoutError(f"array 'x' of {path!r} has a NaN or infinite value at example {bad}")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and not channels_first(path, x.shape, layout):
        x = x.transpose(0, 3, 1, 2)
    x = np.ascontiguousarray(x)
    return torch.from_numpy(x if x.dtype == np.uint8 else x.astype(np.float32))


def build(cfg: dict[str, Any], seed: int) -> DataSplits:
    """The arrays splits of a ``data`` config; ``seed`` (the trial seed) is not used."""
    v = settings(cfg)
    files = find_files(v["root"])
    xs, ys = {}, {}
    for split, path in files.items():
        x, ys[split] = read_npz(path)
        xs[split] = _as_inputs(path, cast(np.ndarray, x), v["layout"])
    shape = _same_example_shape(files, {s: tuple(x.shape[1:]) for s, x in xs.items()})
    num_classes = _labels(files, ys, v["num_classes"])
    ys = {split: y.astype(np.int64) for split, y in ys.items()}
    parts = _held_out(files, ys["train"], v)
    for split, idx in list(parts.items())[::-1]:  # train last
        xs[split], ys[split] = xs["train"][idx], ys["train"][idx]

    scale = 255.0 if xs["train"].dtype == torch.uint8 else 1.0
    if v["normalize"]:
        mean, std = channel_statistics(xs["train"], scale=scale)
    else:
        mean, std = (0.0,) * xs["train"].shape[1], (1.0,) * xs["train"].shape[1]
    class_counts = counts_of(ys["train"], num_classes)
    names = [str(c) for c in range(num_classes)]
    common: dict[str, Any] = dict(num_classes=num_classes, class_counts=class_counts, class_names=names)
    splits = [
        TensorSplit(standardized(xs[s], mean, std, scale=scale), torch.from_numpy(ys[s]), split=s, **common)
        for s in SPLITS
    ]
    info = {
        "files": files,
        "mean": list(mean),
        "std": list(std),
        "held_out_of_train": {s: len(i) for s, i in parts.items() if s != "train"},
    }
    return DataSplits(
        splits[0],
        splits[1],
        splits[2],
        num_classes=num_classes,
        class_counts=class_counts,
        class_names=names,
        input_shape=shape,
        info=info,
    )
