"""Fingerprinting an image folder (not a test): the first run against the disk's read speed, the
rerun against listing the folder (issue 39; docs/performance.md, "Fingerprints").

A folder of ``--files`` files of ``--size`` bytes (random bytes named ``.png``: a fingerprint reads
bytes, it decodes nothing) in ``train/<class>/`` is fingerprinted as a study's preflight does it
(`setvalued.provenance.data_fingerprint`, with a fresh digest cache):

1. the disk: every file read once, in the same order, by as many threads as the fingerprint
   uses, nothing hashed; each file's pages evicted from the page cache before
   (``posix_fadvise(DONTNEED)``: only this folder's, the machine's other users keep theirs);
2. the first run: the same files evicted, then fingerprinted with an empty cache (every file
   read and hashed, the cache written);
3. the rerun: fingerprinted again with the cache (no file read: listed, stat-ed, looked up);
4. the listing alone (`image_folder.list_folder`), the floor of a rerun.

Each is measured ``--rounds`` times, alternating, so that the load of a shared machine falls on
all; the medians and the ratios first-run / disk and rerun / listing are printed.

    python benchmarks/fingerprint_speed.py                      # 50,000 files of 4 KB, 3 rounds
    python benchmarks/fingerprint_speed.py --files 2000 --size 100000 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from setvalued.provenance import DigestCache, data_fingerprint
from setvalued.provenance.file_digests import READERS


def write_folder(root: Path, files: int, size: int, classes: int = 100) -> list[Path]:
    """``files`` files of ``size`` random bytes under ``root/train/c<k>/<i>.png``."""
    paths = []
    per_class = -(-files // classes)
    for i in range(files):
        folder = root / "train" / f"c{i // per_class:03d}"
        if i % per_class == 0:
            folder.mkdir(parents=True)
        path = folder / f"{i:06d}.png"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (written back first)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path]) -> None:
    def read(path: Path) -> None:
        with open(path, "rb") as handle:
            while handle.read(1 << 20):
                pass

    with ThreadPoolExecutor(READERS) as pool:
        list(pool.map(read, paths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per file (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where to write it (default: a temporary folder)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="fingerprint-speed-", dir=args.folder))
    try:
        started = time.perf_counter()
        paths = write_folder(base / "images", args.files, args.size)
        total = args.files * args.size
        took = time.perf_counter() - started
        print(f"{args.files:,} files of {args.size:,} B ({total / 1e6:,.0f} MB) written in {took:.1f} s")
        config = {"name": "image_folder", "root": str(base / "images")}
        times: dict[str, list[float]] = {"disk": [], "first run": [], "rerun": [], "listing": []}
        from setvalued.data import image_folder

        for round_ in range(args.rounds):
            evict(paths)
            started = time.perf_counter()
            read_all(paths)
            times["disk"].append(time.perf_counter() - started)

            evict(paths)
            cache_file = base / f"cache-{round_}.sqlite"
            started = time.perf_counter()
            first = data_fingerprint(config, DigestCache(cache_file))
            times["first run"].append(time.perf_counter() - started)

            started = time.perf_counter()
            again = data_fingerprint(config, DigestCache(cache_file))
            times["rerun"].append(time.perf_counter() - started)
            assert again.digest == first.digest

            started = time.perf_counter()
            image_folder.list_folder(base / "images")
            times["listing"].append(time.perf_counter() - started)
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)

        median = {k: statistics.median(v) for k, v in times.items()}
        load = os.getloadavg()
        print(f"\nmedians of {args.rounds} rounds (load average {load[0]:.1f}, {os.cpu_count()} CPUs):")
        disk = median["disk"]
        print(f"  disk (read every file, {READERS} threads): {disk:.2f} s, {total / disk / 1e6:,.0f} MB/s")
        print(
            f"  first run (read and hash, cache written): {median['first run']:.2f} s, "
            f"{total / median['first run'] / 1e6:,.0f} MB/s, {args.files / median['first run']:,.0f} files/s "
            f"= {median['first run'] / median['disk']:.2f} x the disk"
        )
        print(
            f"  rerun (nothing read): {median['rerun']:.2f} s "
            f"= {median['rerun'] / median['listing']:.2f} x listing the folder ({median['listing']:.2f} s)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
