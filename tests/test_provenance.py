"""What a trial ran, as digests (issue 39): `setvalued.provenance`.

- file digests against hashlib on the same bytes; a rerun reads no file it read before; a file
  replaced in place (same name, size and modification time) is read again;
- the data of every built-in data set with files: the files its loader reads, their digest
  computed independently, changed by an edited file or a renamed class, kept by a copy of the
  folder elsewhere; generated data by its parameters;
- code: a Python file by its syntax tree (comments, docstrings and layout are no change); a
  plugin installed from a local folder by its files, one from an index by its version.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3

import numpy as np
import pytest

from setvalued.provenance import (
    DigestCache,
    combined_digest,
    data_files,
    data_fingerprint,
    data_key,
    plugin_fingerprint,
    python_digest,
)
from tests.test_data import write_fake_cifar, write_fake_imagenet_lt, write_fake_plantnet
from tests.test_data_formats import write_folder


@pytest.fixture
def cache(tmp_path) -> DigestCache:
    return DigestCache(tmp_path / "cache" / "digests.sqlite")


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def brute_force_digest(root, paths) -> str:
    """The folder digest written out: sorted relative paths, each with hashlib's SHA-256."""
    lines = sorted(f"{os.path.relpath(p, root)}\t{sha256(p)}\n" for p in paths)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- file digests


def test_digests_are_sha256_and_a_rerun_reads_nothing(tmp_path, cache):
    files = []
    for i in range(40):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(os.urandom(i * 997 + 1))
        files.append(path)
    seen = []
    assert cache.digests(files, progress=seen.append) == [sha256(p) for p in files]
    assert seen[0].to_read == 40 and seen[-1].read == 40
    seen.clear()
    assert cache.digests(files, progress=seen.append) == [sha256(p) for p in files]
    assert seen[0].to_read == 0 and seen[0].files == 40


def test_a_file_replaced_in_place_with_its_size_and_time_is_read_again(tmp_path, cache):
    path = tmp_path / "set.npz"
    path.write_bytes(b"a" * 1000)
    before = os.stat(path)
    assert cache.digests([path]) == [sha256(path)]
    path.write_bytes(b"b" * 1000)  # the same size ...
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... and modification time
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert cache.digests([path]) == [sha256(path)] and cache.last.read == 1


def test_a_broken_or_unwritable_cache_costs_speed_not_the_answer(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"data")
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"this is not a database" * 100)
    assert DigestCache(broken).digests([path]) == [sha256(path)]
    assert (tmp_path / "broken.sqlite.broken").exists()  # set aside, a new one made
    assert sqlite3.connect(broken).execute("select count(*) from digests").fetchone() == (1,)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's folder would be")
    cache = DigestCache(blocked / "digests.sqlite")
    assert cache.digests([path]) == [sha256(path)] and "cannot be used" in cache.warning


def test_python_is_digested_by_its_code_not_its_comments_docstrings_or_layout(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Doc."""\n\ndef f(x):\n    """Twice."""\n    return x * 2  # double\n')
    digest = python_digest(source)
    source.write_text("# a comment\ndef f(x):\n    '''Another doc.'''\n\n    return (x *\n            2)\n")
    assert python_digest(source) == digest
    source.write_text("def f(x):\n    return x * 3\n")
    assert python_digest(source) != digest
    source.write_text("def f(x:\n")  # does not parse: its bytes
    assert python_digest(source) == sha256(source)


# ----------------------------------------------------------------------------- data


def test_an_image_folder_is_its_files_named_relative_to_the_root(tmp_path, cache):
    root = tmp_path / "images"
    write_folder(root, {"train": {"a": 3, "b": 2}, "test": {"a": 1, "b": 1}})
    (root / "train" / "a" / "notes.txt").write_text("not an image: not read by the loader")
    every_image = sorted(str(p) for p in root.rglob("*.png"))
    config = {"name": "image_folder", "root": str(root)}
    found = data_fingerprint(config, cache)
    assert found.digest == brute_force_digest(root, every_image)
    assert (found.files, found.bytes) == (7, sum(os.path.getsize(p) for p in every_image))
    assert found.source == str(root) and found.schema["x"] == {"dtype": "uint8", "shape": [-1, 3, -1, -1]}

    copy = tmp_path / "elsewhere"
    shutil.copytree(root, copy)
    assert data_fingerprint({"name": "image_folder", "root": str(copy)}, cache).digest == found.digest
    for split in ("train", "test"):  # the same bytes, another class
        os.rename(copy / split / "b", copy / split / "c")
    assert data_fingerprint({"name": "image_folder", "root": str(copy)}, cache).digest != found.digest
    image = root / "test" / "b" / "0000.png"
    image.write_bytes(open(root / "test" / "a" / "0000.png", "rb").read())
    assert data_fingerprint(config, cache).digest != found.digest
    assert cache.last.to_read == 1  # only the changed image was read again


def test_an_npz_replaced_in_place_is_another_data_set(tmp_path, cache):
    path = tmp_path / "digits.npz"
    np.savez(path, x=np.zeros((10, 4)), y=np.arange(10) % 2)
    config = {"name": "arrays", "root": str(path), "val_fraction": 0.2}
    first = data_fingerprint(config, cache)
    assert first.digest == brute_force_digest(tmp_path, [path])
    assert first.schema == {"x": {"dtype": "float32", "shape": [-1, 4]}, "y": {"dtype": "int64", "shape": [-1]}}
    np.savez(path, x=np.ones((10, 4)), y=np.arange(10) % 2)
    assert data_fingerprint(config, cache).digest != first.digest
    assert data_key(config) == data_key({**config, "val_fraction": 0.3, "num_workers": 2})


@pytest.mark.parametrize("name", ["cifar100", "plantnet300k", "imagenet_lt"])
def test_every_official_data_set_is_the_files_its_loader_reads(tmp_path, cache, name):
    root = tmp_path / name
    if name == "cifar100":
        write_fake_cifar(root, 2, 1)
        expected = [root / "cifar-100-python" / f for f in ("train", "test", "meta")]
    elif name == "plantnet300k":
        write_fake_plantnet(root)
        expected = [p for p in (root / "images").rglob("*") if p.suffix in (".jpg", ".png")]
        expected.append(root / "plantnet300K_species_id_2_name.json")  # the class names
    else:
        write_fake_imagenet_lt(root)
        lists = [root / f"ImageNet_LT_{s}.txt" for s in ("train", "val", "test")]
        lists = [p if p.exists() else root / "ImageNet_LT" / p.name for p in lists]
        listed = {str(root / line.split()[0]) for p in lists for line in p.read_text().splitlines() if line.strip()}
        expected = lists + [os.path.abspath(p) for p in sorted(listed)]
    config = {"name": name, "root": str(root)}
    top, files = data_files(config)
    assert sorted(map(os.path.abspath, files)) == sorted(map(os.path.abspath, expected))
    found = data_fingerprint(config, cache)
    assert found.digest == brute_force_digest(top, files)
    target = sorted(files)[-1]
    with open(target, "ab") as handle:
        handle.write(b"\0")
    assert data_fingerprint(config, cache).digest != found.digest


def test_generated_data_is_its_parameters():
    base = {"name": "synthetic", "num_classes": 10}
    digest = data_fingerprint(base).digest
    assert data_fingerprint({**base, "num_workers": 3, "placement": "device"}).digest == digest
    assert data_fingerprint({**base, "train_size": 2000}).digest == digest  # the default, written out
    assert data_fingerprint({**base, "num_classes": 11}).digest != digest
    assert data_fingerprint(base).parameters["train_size"] == 2000


# ----------------------------------------------------------------------------- code


def test_a_local_plugin_is_its_files_and_an_index_one_its_version(tmp_path, monkeypatch):
    from tests.plugin_dists import activate, write_dist

    package = {"__init__.py": "", "decl.py": "X = 1\n", "table.json": '{"a": 1}'}
    points = {"setvalued.losses": {"noop": "myplug.decl:X"}}
    local = write_dist(tmp_path / "a", "myplug-local", "1.0", points, {"myplug": package}, source=tmp_path / "src")
    activate(local, monkeypatch)
    plugin_fingerprint.cache_clear()
    found = plugin_fingerprint("myplug-local")
    assert found.origin == f"editable {(tmp_path / 'src').resolve()}" and found.files == 3
    (local / "myplug" / "decl.py").write_text("# same code\nX = 1\n")
    plugin_fingerprint.cache_clear()
    assert plugin_fingerprint("myplug-local").digest == found.digest
    (local / "myplug" / "table.json").write_text('{"a": 2}')  # a data file of the package
    plugin_fingerprint.cache_clear()
    assert plugin_fingerprint("myplug-local").digest != found.digest

    indexed = write_dist(tmp_path / "b", "myplug-index", "2.0", points, {"myplugb": package})
    activate(indexed, monkeypatch)
    plugin_fingerprint.cache_clear()
    index = plugin_fingerprint("myplug-index")
    expected = hashlib.sha256(b"myplug-index==2.0 index").hexdigest()[:32]
    assert (index.origin, index.version, index.digest) == ("index", "2.0", expected)
    plugin_fingerprint.cache_clear()


def test_combined_digest_orders_nothing_itself():
    assert combined_digest([("a", "1"), ("b", "2")]) != combined_digest([("b", "2"), ("a", "1")])
