"""The CLI and the runner load neither Ray nor torch until cells are about to run.

Each check runs in a fresh interpreter (a subprocess), since this test session has long
imported both. `studies run FILE --dry-run` prints a table: loading Ray (and with torch
about 800 MB) for that is waste.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
RUNNER_SIDE = (
    "studies.running.runner",
    "studies.running.progress",
    "studies.running.trial",
    "studies.tracking",
    "studies.cli",
    "studies.cells.cell_queue",
    "studies.running.checkpoints",
    "studies.scheduling",
    "studies.running.ray_session",
    "studies.scheduling.optuna_rounds",
)


def loaded_after(code: str) -> set[str]:
    """Which of ray, torch and mlflow a fresh interpreter holds after running `code`."""
    check = "import sys; print(' '.join(m for m in ('ray', 'torch', 'mlflow') if m in sys.modules))"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\n{check}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.strip().splitlines()[-1].split()) if done.stdout.strip() else set()


def test_importing_the_runner_side_loads_neither_ray_nor_torch():
    loaded = loaded_after("import " + ", ".join(RUNNER_SIDE))
    assert "ray" not in loaded
    assert "torch" not in loaded


DRY_RUN = f"from studies.cli import main\nassert main(['run', {str(QUICKSTART)!r}, '--dry-run']) == 0"


def test_dry_run_does_not_load_ray():
    assert "ray" not in loaded_after(DRY_RUN)


def test_dry_run_does_not_load_torch():
    assert "torch" not in loaded_after(DRY_RUN)
