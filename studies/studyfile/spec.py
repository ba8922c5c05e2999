"""Study files: read, validate, and report every mistake before any trial starts.

``load_study(path)`` reads a YAML study file (format in docs/interfaces.md, section 6) and
returns a validated :class:`~studies.studyfile.study.Study`. Every problem is raised as one
:class:`~studies.studyfile.problems.StudyError` whose message is a single paragraph naming the file, the
YAML path of the field (``design[0].parameters.loss.epsilon``), its line, and what was
expected. Validation happens in stages, each stopping on its first failing stage so that one
mistake does not cascade into many messages:

1. YAML syntax and duplicate keys (``studies.studyfile.yaml_source``: the node tree gives the lines);
2. the study's own schema (``studies.studyfile.study``: pydantic models, unknown fields forbidden);
3. the trial config of every variant (``base`` deep-merged with the variant's overlay),
   checked against the declarations of ``setvalued.config`` and the loss parameters
   (``studies.studyfile.trial_config``); the names used by the design, ``derived`` and the report are
   cross-checked (``studies.studyfile.cross_checks``);
4. every config the design produces, after the design values and ``derived``
   (``studies.studyfile.configs``), so that a bad dotted path or a value out of range is reported with
   the design entry it came from.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from studies.errors import option
from studies.studyfile.config_bounds import bound_problems
from studies.studyfile.configs import design_configs
from studies.studyfile.cross_checks import check_study
from studies.studyfile.overrides import apply_overrides, parse_overrides, resolved_text
from studies.studyfile.problems import Lines, Path_, Problem, Problems, StudyError, dedupe, format_yaml_path, line_of
from studies.studyfile.study import DEFAULT_MAX_CELLS, Study, schema_problem
from studies.studyfile.yaml_source import MAX_FILE_BYTES, read_yaml

__all__ = ["load_study", "parse_study", "StudyError"]


def load_study(path: str | Path, max_cells: int | None = None, overrides: Sequence[str] = ()) -> Study:
    """Read and validate a study file; raise :class:`StudyError` (one paragraph) when it is wrong.

    ``max_cells`` raises the limit on the number of cells (default: the file's ``max_cells``,
    else ``DEFAULT_MAX_CELLS``), which is checked from the design's sizes before anything is
    built, so that a small file cannot make validation run for hours. ``overrides``: the
    command line's ``key=value`` words (``studies.studyfile.overrides``), applied before validation.
    """
    file = str(path)
    try:
        kind = os.stat(path).st_mode
        if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):  # a FIFO would hang the open
            raise StudyError(
                file,
                [
                    (
                        "(file)",
                        None,
                        "is not a regular file (a FIFO, device or socket); expected the path of a YAML study file",
                    )
                ],
            )
        with open(path, "rb") as handle:  # no more than the limit is read, however large the file
            text = handle.read(MAX_FILE_BYTES + 1).decode("utf-8")
    except FileNotFoundError:
        raise StudyError(file, [("(file)", None, "no such file; expected the path of a YAML study file")]) from None
    except IsADirectoryError:
        raise StudyError(file, [("(file)", None, "is a folder; expected the path of a YAML study file")]) from None
    except PermissionError:
        raise StudyError(
            file, [("(file)", None, "cannot be read (permission denied); expected a readable YAML study file")]
        ) from None
    except UnicodeDecodeError as err:
        raise StudyError(file, [("(file)", None, f"is not UTF-8 text ({err.reason} at byte {err.start})")]) from None
    return parse_study(text, file, max_cells, overrides)


def parse_study(
    text: str, file: str = "<string>", max_cells: int | None = None, overrides: Sequence[str] = ()
) -> Study:
    """Validate study-file text; ``file`` names it in the error messages (``max_cells`` and
    ``overrides``: see :func:`load_study`). With overrides, the study's ``source_text`` is the
    file with them applied (``studies.studyfile.overrides.resolved_text``)."""
    lines: Lines = {}
    design_is_list = True
    reference_is_list = True
    try:
        data, lines = read_yaml(text)
        if data is None:
            raise Problems([Problem((), "the file is empty; expected a mapping with at least name, base and seeds")])
        if not isinstance(data, dict):
            raise Problems(
                [Problem((), f"expected a mapping with at least name, base and seeds, got {type(data).__name__}")]
            )
        if overrides:
            parsed = parse_overrides(overrides, Study.model_fields)
            data = apply_overrides(data, parsed, lines)
            text = resolved_text(data, parsed, file)
        raw = dict(data)
        design = raw.get("design")
        if isinstance(design, dict):  # one block written without the list
            design_is_list = False
            raw["design"] = [design]
        elif design is None and "design" in raw:
            del raw["design"]
        reference_is_list = not isinstance(raw.get("reference"), dict)  # one source, unlisted
        try:
            study = Study.model_validate(raw)
        except ValidationError as err:
            raise Problems([schema_problem(e, raw) for e in err.errors()]) from None
        study.set_source(file, text, lines, design_is_list)
        _check_size(study, max_cells)
        try:
            check_study(study)
        except Problems as cross:
            # a report or reference cross-check can fail because of a mistake in the design (a
            # misspelt parameter that a curve names right): the design's own problems first
            if not all(p.path and p.path[0] in ("report", "reference") for p in cross.problems):
                raise
            raise Problems(design_configs(study)[1] + cross.problems) from None
        configs, problems = design_configs(study)
        if problems:
            raise Problems(problems)
        problems = bound_problems(configs, study.resources.cpus, study.resources.gpus, study.variants)
        if problems:  # values in range that would exhaust the machine (studies.studyfile.config_bounds)
            raise Problems(problems)
        study.set_designed_configs(configs)
    except Problems as problems:

        def file_path(p: Path_) -> Path_:
            # a block written as one mapping is validated as a list of it: back to its path
            if (
                len(p) >= 2
                and p[1] == 0
                and ((p[0] == "design" and not design_is_list) or (p[0] == "reference" and not reference_is_list))
            ):
                return (p[0],) + tuple(p[2:])
            return tuple(p)

        raise StudyError(
            file,
            [
                (format_yaml_path(file_path(p.path)), line_of(lines, file_path(p.path)), p.message)
                for p in dedupe(problems.problems)
            ],
        ) from None
    return study


def _check_size(study: Study, max_cells: int | None) -> None:
    """Stage 2b: refuse a design with more cells than allowed, counted from its sizes."""
    limit = max_cells or study.max_cells or DEFAULT_MAX_CELLS
    configs, cells = study.planned_cells()
    if cells > limit:
        raise Problems(
            [
                Problem(
                    ("design",),
                    f"the design has {cells:,} cells ({configs:,} configs x "
                    f"{len(study.seed_list):,} seeds), more than the limit of {limit:,}; "
                    "expected a smaller design, or a higher limit (max_cells: N in "
                    f"the file, or {option('max_cells')})",
                )
            ]
        )
