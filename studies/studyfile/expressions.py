"""Safe arithmetic expressions for the ``derived`` block of a study file.

A derived parameter is computed from other config values, e.g. a learning rate kept
proportional to the batch size (the average-K batch-size study, [Gar23] §5.9.1, Fig. 5.6)::

    derived:
      optim.lr: "0.1 * optim.batch_size / 64"

The expression is parsed with :mod:`ast` and evaluated by walking a small whitelist of
node types; nothing is handed to ``eval``. Allowed: int and float literals, dotted names of
config values (``optim.batch_size``, ``loss.k``), ``+ - * / // % **``, unary ``+``/``-``,
parentheses and the functions ``min max abs round int float sqrt log log2 log10 exp ceil
floor``.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["Expression", "ExpressionError", "parse_expression", "FUNCTIONS"]

#: longest expression text accepted (a study file is written by hand)
MAX_LENGTH = 500
#: largest integer exponent computed exactly; beyond, ``**`` is computed in floating point
_MAX_INT_EXPONENT = 64
#: largest integer (in bits) a step may produce: a float covers the rest, and no study needs
#: an exact integer past 2**1024 (``((99999 ** 64) ** 64) ** 64`` would take minutes)
MAX_INT_BITS = 1024


def _sqrt(x: float) -> float:
    return math.sqrt(x)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "int": int,
    "float": float,
    "sqrt": _sqrt,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "exp": math.exp,
    "ceil": math.ceil,
    "floor": math.floor,
}

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


class ExpressionError(ValueError):
    """A derived expression that cannot be parsed or evaluated (message says why)."""


def _dotted_name(node: ast.AST) -> str | None:
    """``optim.batch_size`` parses as Attribute(Name('optim'), 'batch_size'); rebuild the path."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _check(node: ast.AST, text: str, names: set[str]) -> None:
    """Reject every node type outside the whitelist; collect the dotted names."""
    if isinstance(node, ast.Expression):
        _check(node.body, text, names)
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ExpressionError(f"only numbers are allowed as constants, got {node.value!r}")
        if isinstance(node.value, int) and node.value.bit_length() > MAX_INT_BITS:
            raise ExpressionError(f"the integer constant is larger than 2**{MAX_INT_BITS}")
    elif isinstance(node, (ast.Name, ast.Attribute)):
        name = _dotted_name(node)
        if name is None:
            raise ExpressionError(f"unsupported construct {ast.get_source_segment(text, node)!r}")
        if name in FUNCTIONS:
            raise ExpressionError(f"{name!r} is a function; call it as {name}(...)")
        names.add(name)
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY and not isinstance(node.op, ast.Pow):
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.left, text, names)
        _check(node.right, text, names)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.UAdd, ast.USub)):
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.operand, text, names)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            func = ast.get_source_segment(text, node.func)
            raise ExpressionError(f"unknown function {func!r}; allowed: {', '.join(sorted(FUNCTIONS))}")
        if node.keywords:
            raise ExpressionError("keyword arguments are not allowed")
        if not node.args:
            raise ExpressionError(f"{node.func.id}() needs at least one argument")
        for arg in node.args:
            _check(arg, text, names)
    else:
        segment = ast.get_source_segment(text, node) if hasattr(node, "lineno") else None
        raise ExpressionError(
            f"unsupported construct {segment or type(node).__name__!r}; expected arithmetic "
            "on numbers and dotted config paths"
        )


@dataclass(frozen=True)
class Expression:
    """A parsed, checked expression: ``names`` are the dotted config paths it reads."""

    text: str
    names: frozenset[str]
    _tree: ast.Expression

    def evaluate(self, values: Mapping[str, Any]) -> int | float:
        """Value of the expression with ``values[path]`` for every dotted path in ``names``."""
        try:
            result = self._eval(self._tree.body, values)
        except ExpressionError:
            raise
        except ZeroDivisionError:
            raise ExpressionError(f"division by zero in {self.text!r}") from None
        except OverflowError:
            raise ExpressionError(f"cannot evaluate {self.text!r}: a step overflows (past 1.8e308)") from None
        except (ValueError, TypeError) as err:
            raise ExpressionError(f"cannot evaluate {self.text!r}: {err}") from None
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise ExpressionError(f"{self.text!r} gave {result!r}, expected a number")
        if isinstance(result, float) and not math.isfinite(result):
            raise ExpressionError(f"{self.text!r} gave {result}, expected a finite number")
        return result

    def _bounded(self, value: Any) -> Any:
        """``value``, unless it is an integer past MAX_INT_BITS bits (each step stays cheap)."""
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ExpressionError(f"{self.text!r} gives an integer larger than 2**{MAX_INT_BITS}")
        return value

    def _eval(self, node: ast.AST, values: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = cast(str, _dotted_name(node))  # a dotted name (checked by _check)
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExpressionError(f"{name} is {value!r}, expected a number")
            return value
        if isinstance(node, ast.UnaryOp):
            operand = self._eval(node.operand, values)
            return -operand if isinstance(node.op, ast.USub) else +operand
        if isinstance(node, ast.BinOp):
            left = self._eval(node.left, values)
            right = self._eval(node.right, values)
            if isinstance(node.op, ast.Pow):
                # Guard against 10**10**10: exact integer powers only for small exponents and
                # results of at most MAX_INT_BITS bits; the rest in floating point.
                if (
                    isinstance(left, int)
                    and isinstance(right, int)
                    and 0 <= right <= _MAX_INT_EXPONENT
                    and left.bit_length() * right <= MAX_INT_BITS
                ):
                    return left**right
                result = float(left) ** float(right)
                if isinstance(result, complex):
                    raise ExpressionError(f"{left} ** {right} is not a real number")
                return result
            return self._bounded(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.Call):
            args = [self._eval(arg, values) for arg in node.args]
            return self._bounded(FUNCTIONS[cast(ast.Name, node.func).id](*args))
        raise ExpressionError(f"unsupported construct in {self.text!r}")  # unreachable after _check


def parse_expression(text: Any) -> Expression:
    """Parse and check ``text``; raises :class:`ExpressionError` with the reason."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ExpressionError(f"expected an arithmetic expression (a string or a number), got {text!r}")
    text = str(text).strip()
    if not text:
        raise ExpressionError("the expression is empty")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        where = f" at column {err.offset}" if err.offset else ""
        raise ExpressionError(f"syntax error in {text!r}{where}: {err.msg}") from None
    names: set[str] = set()
    _check(tree, text, names)
    return Expression(text=text, names=frozenset(names), _tree=tree)
