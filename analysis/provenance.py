"""Where a report's numbers come from: date, MLflow store and runs, study file, code and
package versions, what trained the cells (the driver's environment, the cells' environments,
code and data, and where they differ; cells kept knowingly: `analysis.run_provenance`) and
the interval method, so that a reader can reproduce the report."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import platform
import shlex
import subprocess
import urllib.parse
from pathlib import Path

from analysis.collect import Collected, display_uri
from analysis.layout import UI_ORDER_BY, UI_VIEW_KEY, UI_WORKFLOW, cell_runs_filter
from analysis.results import StudyResults
from analysis.run_provenance import provenance_rows, read_manifest

#: Where `mlflow ui` serves by default.
LOCAL_UI = "http://127.0.0.1:5000"

PROVENANCE_PACKAGES = (
    "setvalued-studies",
    "mlflow",
    "numpy",
    "scipy",
    "pyarrow",
    "matplotlib",
    "pyyaml",
    "torch",
    "ray",
    "optuna",
)
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _git_commit(root: Path) -> str:
    """The checkout's commit, marked when it has uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return "not available (not a git checkout)"
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        suffix = " (with uncommitted changes)" if dirty.stdout.strip() else ""
        return commit.stdout.strip() + suffix
    except (OSError, subprocess.SubprocessError):
        return "not available (git not found)"


def mlflow_ui(collected: Collected) -> tuple[str | None, str, str]:
    """(the command that starts an MLflow UI on the store, or None for a server; the URL of
    the study's cell runs in the UI; the search filter that URL applies).

    The study is its experiment; the URL opens its runs page in the model-training UI on the
    view the experiment holds (`analysis.layout.cell_runs_view`: the cell runs flat, grouped
    by config), or, for an experiment written before it had one, on the same filter and
    order as URL parameters."""
    uri = collected.tracking_uri
    search = cell_runs_filter()
    if uri.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(uri)
        base = urllib.parse.urlunsplit(
            parts._replace(
                netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else ""), query="", fragment=""
            )
        ).rstrip("/")
        command = None
    else:
        base = LOCAL_UI
        command = f"mlflow ui --backend-store-uri {shlex.quote(display_uri(uri))}"
    if collected.ui_view:
        query = f"{UI_WORKFLOW}&viewStateShareKey={UI_VIEW_KEY}"
    else:
        query = urllib.parse.urlencode(
            {"searchFilter": search, "orderByKey": UI_ORDER_BY, "orderByAsc": "true"}, quote_via=urllib.parse.quote
        )
        query = f"{UI_WORKFLOW}&{query}"
    url = f"{base}/#/experiments/{collected.experiment_id}/runs?{query}"
    return command, url, search


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def provenance(results: StudyResults) -> list[tuple[str, str]]:
    """(name, value) pairs for the report's provenance section."""
    versions = []
    for package in PROVENANCE_PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    collected = results.collected
    plugins = [("plugins (losses, data sets, models)", ", ".join(collected.plugins))] if collected.plugins else []
    manifest = read_manifest(_client(collected.tracking_uri), collected.parent_run_id)
    return [
        ("date (UTC)", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")),
        ("MLflow tracking URI", display_uri(collected.tracking_uri)),
        ("MLflow experiment", f"{collected.study_name} (id {collected.experiment_id})"),
        ("parent run", collected.parent_run_id or "none found"),
        (
            "cell runs",
            f"{collected.n_runs} runs; {collected.table.num_rows} finished cells; "
            f"{collected.failed.num_rows} failed or unfinished cells",
        ),
        ("study file", results.study.origin),
        ("project git commit (the report's code)", _git_commit(PROJECT_ROOT)),
        ("python", platform.python_version()),
        ("packages", ", ".join(versions)),
        *plugins,
        *provenance_rows(collected.provenance, manifest),
        (
            "intervals",
            f"{results.level:.0%}, "
            + ("Student's t on n−1 df" if results.method == "t" else f"percentile bootstrap ({results.n_boot})"),
        ),
    ]
