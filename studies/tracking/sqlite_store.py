"""A new embedded tracking store starts as a copy of an empty one, made once per MLflow version.

MLflow creates the tables of a new SQLite store by running its whole chain of schema
migrations (about 70 Alembic scripts): 1.5 s of every new study's start on this project's
reference machine, for a file that is the same each time. `seed_sqlite_store` makes that
empty store once per MLflow version in the user's cache folder (`$XDG_CACHE_HOME` or
`~/.cache`, `setvalued-studies/`) and copies it to a new study's path; MLflow then opens it as
its own (it checks the schema version on every open). Any failure (a read-only home, a full
disk) leaves the path alone and MLflow creates the store itself, as before.

Only the `Default` experiment of the copy differs from a store made in place: its artifact
location is the template's (`<cache>/mlruns`). The studies never use that experiment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SQLITE_PREFIX = "sqlite:///"


def cache_folder() -> Path:
    """Where the empty store of each MLflow version is kept."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "setvalued-studies"


def _template(folder: Path) -> Path:
    """The empty store of the installed MLflow version, made when missing (atomically: two
    drivers that make it at once both end with a complete file)."""
    import mlflow
    from mlflow import MlflowClient

    path = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=".mlflow-empty-", suffix=".db", dir=folder)
    os.close(handle)
    os.unlink(partial)  # MLflow creates the tables in a file that does not exist yet
    try:
        client = MlflowClient(f"{SQLITE_PREFIX}{partial}")
        client.search_experiments(max_results=1)  # the store is created and migrated
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def seed_sqlite_store(tracking_uri: str) -> bool:
    """Give a local SQLite tracking store that does not exist yet the empty store's tables;
    True when it was copied. Other URIs, and existing files, are left alone."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return False
    target = Path(tracking_uri[len(SQLITE_PREFIX) :])
    if target.exists() or not target.parent.is_dir():
        return False
    try:
        template = _template(cache_folder())
        handle, partial = tempfile.mkstemp(prefix=".mlflow-", suffix=".db", dir=target.parent)
        os.close(handle)
        try:
            shutil.copyfile(template, partial)
            # a hard link creates the file only if it is absent: a store that another driver
            # of the study made meanwhile is never replaced (FileExistsError)
            os.link(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    except Exception:  # noqa: BLE001  (MLflow makes the store itself, 1.5 s slower)
        return False
    return True
