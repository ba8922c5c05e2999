"""Declared parameter constraints: one :class:`Param` per setting, read by every checker.

A loss's parameters (``setvalued.losses.parameters``) and the trial config's fields
(``setvalued.config``) are declared once as ``Param`` objects: type, default, range or
options, and a line of documentation. ``Param.check`` is the trainer's and ``build_loss``'s
check; the study-file validation (``studies``) reads the same declarations to build its
schema, and the documentation table is generated from them. Pure Python: no torch, so
validating a study does not load PyTorch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Param", "ParameterError", "REQUIRED"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: default of a parameter that has none: it must be given
REQUIRED: Any = _Required()

#: the scalar types a Param can declare, and how a requirement names them
_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "any": "a value"}


class ParameterError(ValueError):
    """A value that breaks its declaration.

    ``parameter`` is its name (or dotted path), ``requirement`` what it must be ("an integer >= 1"),
    ``value`` what was given; ``wrong_type`` tells a value of the wrong kind from one out of range.
    ``str(err)`` reads ``"<owner> parameter <name> must be <requirement>, got <value>"``
    (without the owner part when there is none); ``err.text`` is the part after the owner.
    """

    def __init__(self, parameter: str, requirement: str, value: Any, *, owner: str = "", wrong_type: bool = False):
        self.parameter = parameter
        self.requirement = requirement
        self.value = value
        self.owner = owner
        self.wrong_type = wrong_type
        self.text = f"{parameter} must be {requirement}, got {value!r}"
        super().__init__(f"{owner} parameter {self.text}" if owner else self.text)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Param:
    """One declared parameter.

    ``type`` is ``int``, ``float``, ``bool``, ``str``, ``any`` or ``list`` (then ``item`` declares
    the items and ``length`` the allowed lengths ``(min, max)``); ``low``/``high`` bound a number
    (open with ``low_open``/``high_open``); ``options`` lists the allowed values; ``nullable``
    admits None; ``rule`` is a last check ``value -> value`` that raises ValueError with the whole
    requirement (for what a range cannot say, such as "false or a file path"); ``implicit``
    keeps the default out of the configs a study writes (see the field).
    """

    type: str
    default: Any = REQUIRED
    doc: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    options: tuple[Any, ...] | None = None
    nullable: bool = False
    item: Param | None = None
    length: tuple[int, int | None] | None = None
    rule: Callable[[Any], Any] | None = field(default=None, compare=False)
    #: a setting that changes how, not what, is computed (``exact``), or a field added after
    #: studies were run whose default keeps the earlier behaviour (the conformal baselines, the
    #: multi-label data): a config holds it only when it differs from the default, so that
    #: adding it changed no existing config_id
    implicit: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    # ----- words ----------------------------------------------------------------------------

    def bounds_text(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1]``, ``in [0, 1)``; empty when unbounded."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{self.low!r}, {self.high!r}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low!r}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high!r}"
        return ""

    def requirement(self) -> str:
        """What a value must be, in words: ``an integer >= 1``, ``one of 'ml', 'sccp'``."""
        if self.options is not None:
            return "one of " + ", ".join(repr(o) for o in self.options)
        if self.type == "list":
            inner = self.item.requirement() if self.item else "values"
            inner = inner.replace("an integer", "integers").replace("a number", "numbers", 1)
            return f"a list of {inner}"
        words = _TYPE_WORDS[self.type]
        bounds = self.bounds_text()
        if self.type == "int" and bounds:
            return f"{words} {bounds}"
        if self.type == "float" and bounds:
            return bounds
        return words

    def describe(self) -> str:
        """What a value may be, for documentation: the requirement with its type spelled out."""
        text = self.requirement()
        if self.type == "float" and self.options is None and self.bounds_text():
            text = f"a number {text}"
        return text + (" or null" if self.nullable else "")

    # ----- checking ---------------------------------------------------------------------------

    def check(self, name: str, value: Any, owner: str = "") -> Any:
        """``value`` coerced to the declared type (5.0 -> 5 for an int, 1 -> 1.0 for a number);
        :class:`ParameterError` naming ``name`` when it breaks the declaration."""

        def fail(requirement: str, wrong_type: bool = False) -> ParameterError:
            return ParameterError(name, requirement, value, owner=owner, wrong_type=wrong_type)

        if value is None:
            if self.nullable:
                return None
            raise fail(self.requirement(), wrong_type=True)
        if self.type == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not _is_int(value):
                raise fail(_TYPE_WORDS["int"], wrong_type=True)
            value = int(value)
        elif self.type == "float":
            if not _is_real(value):
                raise fail(_TYPE_WORDS["float"], wrong_type=True)
            if not math.isfinite(float(value)):
                raise fail("finite")
            value = float(value)
        elif self.type == "bool":
            if not isinstance(value, bool):
                raise fail(_TYPE_WORDS["bool"], wrong_type=True)
        elif self.type == "str":
            if not isinstance(value, str):
                raise fail(self.requirement(), wrong_type=True)
        elif self.type == "list":
            if not isinstance(value, (list, tuple)):
                raise fail(self.requirement(), wrong_type=True)
            low, high = self.length or (0, None)
            if len(value) < low or (high is not None and len(value) > high):
                count = f"{low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
                raise fail(f"{self.requirement()} ({count} items)")
            if self.item is not None:
                try:
                    value = [self.item.check(f"{name}[{i}]", v) for i, v in enumerate(value)]
                except ParameterError:
                    raise fail(self.requirement(), wrong_type=True) from None
            else:
                value = list(value)
        if self.options is not None and value not in self.options:
            raise fail(self.requirement())
        if self.type in ("int", "float") and not self._in_bounds(value):
            raise fail(self.requirement())
        if self.rule is not None:
            try:
                value = self.rule(value)
            except ValueError as err:
                raise fail(str(err)) from None
        return value

    def _in_bounds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


def check_parameters(declared: Mapping[str, Param], given: Mapping[str, Any], owner: str = "") -> dict[str, Any]:
    """Every declared parameter of ``given`` checked and coerced, defaults filled in.

    Raises :class:`ParameterError` for a bad value or a missing required one; unknown names
    are the caller's to reject (it knows what else may be passed).
    """
    out = {}
    for name, param in declared.items():
        if name in given:
            out[name] = param.check(name, given[name], owner)
        elif param.required:
            raise ParameterError(name, param.requirement() + " (required)", None, owner=owner)
        else:
            out[name] = param.default
    return out


__all__ += ["check_parameters"]
