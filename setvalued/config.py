"""Checks shared by the builders of the trial config's sections (docs/interfaces.md, section 1)."""

from __future__ import annotations

from typing import Iterable, Mapping


def reject_unknown_keys(section: str, given: Mapping, known: Iterable[str]) -> None:
    """Raise a ValueError naming every key of ``given`` not in ``known`` by its dotted path.

    ``section`` is the path prefix (``"data"``, ``"model"``...); an empty one names top-level keys.
    """
    known = list(known)
    unknown = sorted(set(given) - set(known))
    if unknown:
        where = f"{section} config" if section else "top-level config"
        paths = ", ".join(f"{section}.{key}" if section else key for key in unknown)
        raise ValueError(f"unknown key(s) in {where}: {paths}; known keys: {', '.join(known)}")
