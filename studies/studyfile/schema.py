"""The pydantic conventions of the study-file schema, and its errors in the user's words.

Every schema model of a study file derives from :class:`StrictModel` (unknown fields are
mistakes, no inf or NaN); :func:`pydantic_problems` turns pydantic's errors into
:class:`~studies.studyfile.problems.Problem` objects whose messages read "expected ..., got ...".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from studies.studyfile.problems import Path_, Problem

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

__all__ = ["StrictModel", "pydantic_problems", "pydantic_message", "short_repr", "fields_of"]


class StrictModel(BaseModel):
    """Base of the study-file schema: unknown fields forbidden, no inf/NaN, defaults validated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pydantic_problems(err: ValidationError, prefix: Path_ = ()) -> list[Problem]:
    """One Problem per pydantic error, its path under ``prefix``."""
    return [Problem(prefix + tuple(e["loc"]), pydantic_message(e)) for e in err.errors()]


def pydantic_message(e: ErrorDetails) -> str:
    """A pydantic error in the words of the study-file messages ("expected ..., got ...")."""
    kind = e["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "missing required field"
    if kind == "too_short" and "ctx" in e:
        n = e["ctx"].get("min_length", 1)
        return f"expected at least {n} item{'s' if n != 1 else ''}, got {short_repr(e.get('input'))}"
    if kind == "string_pattern_mismatch":
        return (
            f"expected letters, digits, '_', '.' or '-' only (starting with a letter or digit), "
            f"got {short_repr(e.get('input'))}"
        )
    msg = e["msg"]
    if msg.startswith("Value error, "):
        return msg[len("Value error, ") :]
    if msg.startswith("Assertion failed, "):
        return msg[len("Assertion failed, ") :]
    if msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be ") :]
    if "input" in e and kind not in ("union_tag_not_found", "union_tag_invalid"):
        msg += f", got {short_repr(e['input'])}"
    return msg


def fields_of(model: type[BaseModel]) -> str:
    """The field names of a model (aliases where set), comma-separated."""
    return ", ".join(info.alias or name for name, info in model.model_fields.items())
