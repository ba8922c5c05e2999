"""What a study writes to MLflow and how it is found again: the contract tags and params of
a cell's run (docs/interfaces.md section 5), the experiment's tags, the search helpers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from analysis.layout import (  # the MLflow layout, shared with analysis.collect
    PARENT_RUN_TAG,
    ROLE_CELL,
    STATUS_FINISHED,
    STATUS_RUNNING,
    TAG_CELL_ID,
    TAG_CONFIG_ID,
    TAG_CONFIG_NAME,
    TAG_ROLE,
    TAG_SEED,
    TAG_SESSION,
    TAG_STATUS,
    TAG_STUDY,
    TAG_SWEPT,
    TAG_VARIANT,
    TAG_VERSION,
    UI_RUN_COLOR_TAG,
    UI_VIEW_KEY,
    UI_WORKFLOW,
    cell_runs_view_tag,
    flatten_config,
)
from setvalued import registry
from setvalued.config import effective_config
from studies.cells.run_names import config_name
from studies.tracking.retry import with_retry

# Key whose history tells which epochs a run already holds (fit always reports it; the
# trial adds it when a fit function does not).
EPOCH_MARKER_METRIC = "epoch_time_s"

SEARCH_PAGE = 1_000  # runs per search_runs page: what one page holds in memory is bounded
MAX_PARAMS_TAGS_PER_BATCH = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
MAX_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
_MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_LENGTH = 8000

T = TypeVar("T")

#: the artifact folder of a cell's selected model (MLflow's pytorch flavour)
MODEL_ARTIFACT = "model"
#: the experiment's kind for MLflow versions that read it (3.17 does not: it takes the UI from
#: the URL or the browser, `analysis.layout.UI_WORKFLOW`); a link to its runs page says so itself
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: the experiment's (and a run's) description in the MLflow UI
NOTE_TAG = "mlflow.note.content"


def source_tags(study_file: str | Path) -> dict[str, str]:
    """The system tags MLflow's own clients set on a run: who ran it, from which file, and the
    git commit, branch and remote of the checkout holding the study file, if it is in one."""
    import getpass
    import subprocess

    path = Path(study_file).resolve()
    tags = {"mlflow.source.name": str(path), "mlflow.source.type": "LOCAL"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no user name in this container
        pass

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=path.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None

    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        for key, args in (
            ("mlflow.source.git.branch", ("rev-parse", "--abbrev-ref", "HEAD")),
            ("mlflow.source.git.repoURL", ("config", "--get", "remote.origin.url")),
        ):
            value = git(*args)
            if value:
                tags[key] = value
    return tags


def experiment_tags(
    description: str, view: Mapping[str, Any] | None = None, experiment_id: str | None = None
) -> dict[str, str]:
    """A study's experiment: its kind, the view of its cell runs that the report links to
    (`view`, default `analysis.layout.cell_runs_view()`), and its note: once the experiment
    has an id, a link to that view on the first line (`runs_link_note`), then the study's
    description (``study_description``). MLflow 3.17 opens the bare experiment page, where its
    experiment list leads, in its GenAI UI in a fresh browser, showing the note's first line:
    the link is how a person gets from there to the cell runs."""
    key, value = cell_runs_view_tag(view)
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, key: value}
    link = runs_link_note(experiment_id) if experiment_id is not None else ""
    note = "\n\n".join(part for part in (link, description) if part)
    if note:
        tags[NOTE_TAG] = note
    return tags


#: the line of an experiment's note that links to its cell runs (`runs_link_note`)
RUNS_LINK_TEXT = "The cell runs, grouped by config, with the study's columns and charts"


def runs_link_note(experiment_id: str) -> str:
    """A Markdown link, relative to the MLflow UI it is shown in, to the experiment's cell
    runs in the model-training UI's runs page (table view; the charts are one click away)."""
    return f"[{RUNS_LINK_TEXT}](#/experiments/{experiment_id}/runs?{UI_WORKFLOW}&viewStateShareKey={UI_VIEW_KEY})"


def study_description(description: str, source_text: str) -> str:
    """The study's ``description:``, else the comment lines that open its file."""
    if description.strip():
        return description.strip()
    lines = []
    for line in source_text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines).strip()


def default_tracking_uri(study_dir: str | Path) -> str:
    """The embedded tracking store of a study: `sqlite:///<output>/<name>/mlflow.db`."""
    return f"sqlite:///{Path(study_dir).resolve() / 'mlflow.db'}"


def ui_command(tracking_uri: str) -> str:
    """The shell command that opens the MLflow UI on this tracking store."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} in a browser (MLflow server)"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def param_text(value: Any) -> str:
    """An MLflow param string: strings as they are, everything else as JSON."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if len(text) > _MAX_PARAM_LENGTH:
        text = text[: _MAX_PARAM_LENGTH - 3] + "..."
    return text


def config_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The nested trial config as MLflow params with dotted keys (`loss.epsilon` -> '0.1').

    Lists stay whole (JSON text); an empty mapping is kept as '{}' so that it is not lost.
    """
    effective = effective_config(config, registry.plugin_sections(config))
    return {
        path: param_text(dict(value) if isinstance(value, Mapping) else value)
        for path, value in flatten_config(effective).items()
    }


def config_of_params(params: Mapping[str, str]) -> dict[str, Any]:
    """The nested trial config of a cell run's params, `config_params`'s inverse: dotted paths
    nested, each value read as JSON where it reads as JSON (numbers, booleans, null, lists,
    mappings), else the string (`param_text` writes strings as they are); ``seed`` left out."""
    config: dict[str, Any] = {}
    for path, text in sorted(params.items()):
        if path == "seed":
            continue
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        try:
            node[leaf] = json.loads(text)
        except ValueError:
            node[leaf] = text
    return config


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def in_chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def as_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number


def tracking_client(tracking_uri: str):
    """An MLflow client of `tracking_uri`, retried while the store is locked (`with_retry`): a
    SQLite store's client reads its tables when it is made, and a trial starting while another
    process holds the lock would fail the cell."""
    from mlflow import MlflowClient

    return with_retry(lambda: MlflowClient(tracking_uri=tracking_uri))


def search_all(client, experiment_id: str, filter_string: str) -> list:
    """Every active run of the experiment matching the filter (all pages), oldest first; each
    page's request retried through an outage (`with_retry`)."""
    from analysis.collect import search_all_runs

    return list(search_all_runs(client, experiment_id, filter_string, page_size=SEARCH_PAGE, call=with_retry))


def finished_runs(runs: Iterable) -> list:
    """The runs tagged `studies.status=finished` among `runs` (`RunRecord`s), in their order
    (oldest first as the ledger groups them): a cell is done when it has one."""
    return [r for r in runs if r.tags.get(TAG_STATUS) == STATUS_FINISHED]


def cell_tags(
    cell: Mapping[str, Any], study_name: str, parent_run_id: str, session_id: str, version: str = ""
) -> dict[str, str]:
    """The contract tags of a cell's child run (docs/interfaces.md section 5), with its
    config's readable name (from the cell's ``run_name``, else its variant), the study's version
    (the cell's, else `version`: the session's) and its colour in the MLflow UI's charts (the
    cell's ``color``, when it has one)."""
    run_name = cell.get("run_name")
    version = str(cell.get("version") or version or "")
    return {
        **({TAG_VERSION: version} if version else {}),
        PARENT_RUN_TAG: parent_run_id,
        TAG_ROLE: ROLE_CELL,
        TAG_STUDY: study_name,
        TAG_CONFIG_ID: str(cell["config_id"]),
        TAG_SEED: str(cell["seed"]),
        TAG_CELL_ID: str(cell["cell_id"]),
        TAG_VARIANT: str(cell.get("variant") or ""),
        TAG_CONFIG_NAME: config_name(run_name, cell["seed"])
        if run_name
        else str(cell.get("variant") or cell["config_id"]),
        TAG_SWEPT: canonical_json(cell.get("swept") or {}),
        TAG_STATUS: STATUS_RUNNING,
        TAG_SESSION: session_id,
        **({UI_RUN_COLOR_TAG: cell["color"]} if cell.get("color") else {}),
    }
