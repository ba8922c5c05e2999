"""The study file as the report reads it: plain YAML, its `report`/`reference` blocks parsed.

The report needs only a few things from the study file (the two blocks, the variants'
names and overlays, the objective, the description), so it reads the file with plain YAML
and parses the two blocks with `analysis.report_schema`, the schema study validation uses
too; the rest of the file is not validated here (that needs the trial configs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from analysis.collect import Collected
from analysis.layout import flatten_config
from analysis.report_schema import Reference, Report


class ReportError(ValueError):
    """The study file or its `report`/`reference` block cannot be used (names file and path)."""


@dataclass
class StudyInfo:
    """What the report needs from the study file: its text, where it came from, the raw
    mapping, and the parsed `report` and `reference` blocks."""

    text: str | None
    origin: str
    data: dict = field(default_factory=dict)
    report: Report = field(default_factory=Report)
    reference: Reference | None = None

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
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ReportError(f"study file {origin}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ReportError(f"study file {origin}: the top level must be a mapping, "
                          f"got {type(data).__name__}")
    report = _parse_block(Report, data, "report", origin)
    reference = _parse_block(Reference, data, "reference", origin)
    return StudyInfo(text, origin, data, report or Report(), reference)


def _parse_block(model: type, data: dict, key: str, origin: str) -> Any:
    """`data[key]` validated by `model`; None when the block is absent (or null)."""
    block = data.get(key)
    if block is None:
        return None
    try:
        return model.model_validate(block)
    except ValidationError as exc:
        problems = "; ".join(_problem_text(key, error) for error in exc.errors())
        raise ReportError(f"study file {origin}: {problems}") from None


def _problem_text(key: str, error: dict) -> str:
    """One schema error in the words of study validation:
    "`report.tables[1].columns`: expected 'metrics' or 'variant', got 'sideways'"."""
    path = key + "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                         for part in error["loc"])
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

