"""The study file as the report reads it: plain YAML, its `report`/`reference` blocks parsed.

The report needs only a few things from the study file (the two blocks, the variants'
names and overlays, the objective, the description), so it reads the file with plain YAML
and parses the two blocks with `analysis.report_schema`, the schema study validation uses
too; the rest of the file is not validated here (that needs the trial configs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import TypeAdapter, ValidationError

from analysis.collect import Collected
from analysis.layout import flatten_config
from analysis.published_number import keep_reference_texts
from analysis.report_schema import Reference, References, Report

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

_REFERENCES = TypeAdapter(References)


class ReportError(ValueError):
    """The study file or its `report`/`reference` block cannot be used (names file and path)."""


@dataclass
class StudyInfo:
    """What the report needs from the study file: its text, where it came from, the raw
    mapping, and the parsed `report` and `reference` blocks (`reference`: its sources, each
    with its column label; empty when the file has none)."""

    text: str | None
    origin: str
    data: dict = field(default_factory=dict)
    report: Report = field(default_factory=Report)
    reference: list[Reference] = field(default_factory=list)

    @property
    def variant_order(self) -> list[str]:
        variants = self.data.get("variants")
        return list(variants) if isinstance(variants, dict) else []

    def variant_paths(self) -> set[str]:
        """Dotted paths set by any variant overlay (they define a variant, not a context)."""
        paths: set[str] = set()
        variants = self.data.get("variants")
        if isinstance(variants, dict):
            for overlay in variants.values():
                if isinstance(overlay, dict):
                    paths |= set(flatten_config(overlay))
        return paths


def load_study_info(study_file: str | Path | None, collected: Collected) -> StudyInfo:
    """The study file given, else the `study.yaml` artifact of the study's parent run."""
    if study_file is not None:
        path = Path(study_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ReportError(f"study file {path}: cannot be read ({exc})") from exc
        origin = str(path)
    elif collected.study_yaml is not None:
        text, origin = collected.study_yaml, f"artifact study.yaml of run {collected.parent_run_id}"
    else:
        return StudyInfo(None, "none (no study file given and no study.yaml artifact)")
    try:
        data = _read_yaml(text)
    except yaml.YAMLError as exc:
        raise ReportError(f"study file {origin}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ReportError(f"study file {origin}: the top level must be a mapping, got {type(data).__name__}")
    report = _parse_block(Report.model_validate, data, "report", origin)
    reference = _parse_block(_REFERENCES.validate_python, data, "reference", origin)
    return StudyInfo(text, origin, data, report or Report(), reference or [])


def _read_yaml(text: str) -> Any:
    """The file's data (safe loader), the reference numbers keeping their written text."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()
    keep_reference_texts(root, data)
    return data or {}


def _parse_block(validate: Any, data: dict, key: str, origin: str) -> Any:
    """`data[key]` validated; None when the block is absent (or null)."""
    block = data.get(key)
    if block is None:
        return None
    try:
        return validate(block)
    except ValidationError as exc:
        # the one-source `reference` mapping is validated as a list of it: its errors are
        # located in the mapping as written
        drop_index = key == "reference" and isinstance(block, dict)
        problems = "; ".join(_problem_text(key, error, drop_index) for error in exc.errors())
        raise ReportError(f"study file {origin}: {problems}") from None


def _problem_text(key: str, error: ErrorDetails, drop_index: bool = False) -> str:
    """One schema error in the words of study validation:
    "`report.tables[1].columns`: expected 'metrics' or 'variant', got 'sideways'"."""
    loc = error["loc"][1:] if drop_index and error["loc"][:1] == (0,) else error["loc"]
    path = key + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    if error["type"] == "missing":
        return f"`{path}`: missing required field"
    if error["type"] == "extra_forbidden":
        return f"`{path}`: unknown field"
    if error["type"] == "too_short":
        n = error["ctx"]["min_length"]
        return f"`{path}`: expected at least {n} item{'s' if n != 1 else ''}, got {error['input']!r}"
    message = error["msg"].removeprefix("Value error, ")
    if message.startswith("Input should be "):
        message = "expected " + message.removeprefix("Input should be ")
    if error["type"] != "value_error":  # a validator's own message shows the value already
        message += f", got {error['input']!r}"
    return f"`{path}`: {message}"


#: the longest study file of a version shown in the report (a larger artifact is cut)
MAX_VERSION_FILE_BYTES = 1024 * 1024


def version_files(collected: Collected, versions: list[str]) -> dict[str, str | None]:
    """The study file of each version, from the parent run's ``versions/<version>/study.yaml``
    (`analysis.layout.VERSIONS_ARTIFACT_DIR`); None where it cannot be read."""
    import tempfile

    from analysis.collect_store import quiet_downloads, tracking_client
    from analysis.layout import STUDY_ARTIFACT, VERSIONS_ARTIFACT_DIR

    texts: dict[str, str | None] = {v: None for v in versions}
    if collected.parent_run_id is None:
        return texts
    try:
        client = tracking_client(collected.tracking_uri)
    except Exception:  # noqa: BLE001 (no store reachable: the report says the files are missing)
        return texts
    with tempfile.TemporaryDirectory() as tmp, quiet_downloads():
        for version in versions:
            try:
                local = client.download_artifacts(
                    collected.parent_run_id, f"{VERSIONS_ARTIFACT_DIR}/{version}/{STUDY_ARTIFACT}", tmp
                )
                with open(local, "rb") as handle:
                    texts[version] = handle.read(MAX_VERSION_FILE_BYTES).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 (an unreadable earlier version is left out of the report)
                continue
    return texts
