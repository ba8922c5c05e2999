"""image_folder against synthetic images (not a test): the same 4-cell study, side by side.

Issue #32's target: a 4-cell smoke study of 32 x 32 PNGs on ``image_folder`` runs within 2x of
the same study on ``synthetic`` image-shaped data (before, a folder of small PNGs could only be
disguised as Pl@ntNet-300K, resized to 256 and cropped to 224: 4 cells x 3 epochs took 4 min 53 s).

The PNGs are the synthetic set itself (``data.form: images``, the same class counts and sizes),
its pixels mapped to 0..255 and written as ``<split>/<class>/<i>.png``, so both studies train the
same model (``small_cnn``) on the same number of 3 x 32 x 32 examples; they differ only in the
data section. Two measurements, each alternating the two data sets ``--rounds`` times so that
the load of a shared machine falls on both:

1. ``fit`` of the 4 cells in this process (no Ray): data building (PNG decoding for the folder)
   and training, the cost the data set adds;
2. ``studies run`` of each study in a fresh process on a local Ray with a SQLite store: the
   whole study as a user runs it (start-up included).

    python benchmarks/image_folder_speed.py                 # 3 epochs, 2 rounds
    python benchmarks/image_folder_speed.py --epochs 1 --rounds 1 --no-studies
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

SYNTHETIC = {
    "name": "synthetic",
    "num_classes": 10,
    "num_superclasses": 2,
    "train_size": 1000,
    "val_size": 200,
    "test_size": 200,
    "form": "images",
    "feature_dim": 16,
}


def write_pngs(folder: Path) -> None:
    """The synthetic images as PNG files in class folders (pixels: 128 + 40 x value, clipped)."""
    import numpy as np
    from PIL import Image

    from setvalued.data import build_datasets

    data = build_datasets(SYNTHETIC)
    for split in data:
        pixels = (split.inputs.numpy() * 40 + 128).clip(0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
        for i, (image, label) in enumerate(zip(pixels, split.targets.tolist())):
            target = folder / split.split / f"class{label:02d}"
            target.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(target / f"{i:05d}.png")


def study(name: str, data: dict, epochs: int) -> dict:
    """4 cells: the cross-entropy and the noised top-K loss, 2 seeds each."""
    return {
        "name": name,
        "seeds": [0, 1],
        "resources": {"cpus": 1},
        "base": {
            "data": data,
            "model": {"name": "small_cnn", "hidden_dim": 16},
            "loss": {"name": "ce"},
            "optim": {"lr": 0.05, "batch_size": 64, "milestones": []},
            "epochs": epochs,
            "eval": {"ks": [1, 3], "selection": "val/top3"},
            "device": "cpu",
        },
        "variants": {
            "ce": {"loss": {"name": "ce"}},
            "topk": {"loss": {"name": "noised_topk", "k": 3, "epsilon": 0.2, "n_samples": 5}},
        },
    }


def cells(spec: dict) -> list[tuple[dict, int]]:
    out = []
    for variant in spec["variants"].values():
        config = copy.deepcopy(spec["base"])
        config.update(copy.deepcopy(variant))
        out += [(config, seed) for seed in spec["seeds"]]
    return out


def time_fits(spec: dict) -> float:
    from setvalued.training import fit

    start = time.perf_counter()
    for config, seed in cells(spec):
        fit(config, seed)
    return time.perf_counter() - start


def time_study(path: Path, folder: Path, num_cpus: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from studies.cli import main; sys.exit(main())",
            "run",
            str(path),
            "--tracking-uri",
            f"sqlite:///{folder}/mlflow.db",
            "--output",
            str(folder / "out"),
            "--num-cpus",
            str(num_cpus),
            "--no-report",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=3600,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"studies run {path.name} failed:\n{done.stderr[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two data sets")
    parser.add_argument("--num-cpus", type=int, default=2, help="local Ray CPUs of `studies run`")
    parser.add_argument("--no-studies", action="store_true", help="only the in-process fits")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # as a Ray worker with resources.cpus: 1
    folder = Path(tempfile.mkdtemp(prefix="image-folder-speed-"))
    try:
        write_pngs(folder / "pngs")
        specs = {
            "synthetic": study("speed-synthetic", SYNTHETIC, args.epochs),
            "image_folder": study(
                "speed-image-folder", {"name": "image_folder", "root": str(folder / "pngs")}, args.epochs
            ),
        }
        times: dict[str, dict[str, list[float]]] = {kind: {"fit": [], "study": []} for kind in specs}
        for spec in specs.values():  # warm-up: imports, first-call costs
            _, seed = cells(spec)[0]
            time_fits({**spec, "seeds": [seed], "variants": {"w": {"epochs": 1}}})
        for _ in range(args.rounds):
            for kind, spec in specs.items():
                times[kind]["fit"].append(time_fits(spec))
        if not args.no_studies:
            for _ in range(args.rounds):
                for kind, spec in specs.items():
                    path = folder / f"{spec['name']}.yaml"
                    path.write_text(yaml.safe_dump(spec))
                    shutil.rmtree(folder / "out", ignore_errors=True)
                    times[kind]["study"].append(time_study(path, folder, args.num_cpus))
        print(
            f"4 cells x {args.epochs} epochs, small_cnn, 1,400 images of 3 x 32 x 32, "
            f"{args.rounds} round(s), median seconds:"
        )
        print(f"{'':28}{'synthetic':>12}{'image_folder':>14}{'ratio':>8}")
        for what, label in (("fit", "fit x 4 (no Ray)"), ("study", "studies run (local Ray)")):
            if not times["synthetic"][what]:
                continue
            a, b = (statistics.median(times[k][what]) for k in ("synthetic", "image_folder"))
            print(f"{label:28}{a:12.1f}{b:14.1f}{b / a:8.2f}")
        print("target: ratio <= 2 (issue #32)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
