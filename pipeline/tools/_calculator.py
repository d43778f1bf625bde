"""A calculator tool that evaluates arithmetic safely: parsed, never ``eval``-ed.

The expression is parsed with :mod:`ast` and walked; only numbers, ``+ - * / // % **`` and
parentheses are allowed, and sizes are bounded (expression length, exponent, result), so a
model cannot make it run for long or use much memory.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from pipeline._exceptions import PipelineError
from pipeline.tools._registry import FunctionTool

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15


class CalculatorError(PipelineError, ValueError):
    """The expression is not plain arithmetic, or its result is out of bounds."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate ``expression`` (e.g. ``"(12 + 5) * 3 / 2"``) without ``eval``.

    Returns:
        An int when the result is integral (``6 / 2`` gives ``3``), else a float.

    Raises:
        CalculatorError: not arithmetic, division by zero, or a size limit exceeded.
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    except ValueError as exc:  # e.g. a null character
        raise CalculatorError(f"not an arithmetic expression: {exc}") from None
    value = _walk(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(
            node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_walk(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):
            raise CalculatorError("result is not a real number")
        return _bounded(result)
    raise CalculatorError(f"unsupported element {type(node).__name__!r}: only numbers, "
                          "+ - * / // % ** and parentheses are allowed")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result larger than {MAX_MAGNITUDE:g}")
    return value


def format_number(value: int | float) -> str:
    """Render a result the way the tool replies: ints plainly, floats to 10 significant digits."""
    return str(value) if isinstance(value, int) else f"{value:.10g}"


async def _calculate(expression: str) -> str:
    return format_number(evaluate_arithmetic(expression))


def calculator_tool(timeout_s: float = 5.0) -> FunctionTool:
    """The ``calculator`` tool: ``{"expression": str}`` in, the result as text out.

    Errors (bad expression, division by zero) raise :class:`CalculatorError`; the tool-calling
    stage turns them into an error message for the model.
    """
    return FunctionTool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {
                "type": "string", "description": "for example (12 + 5) * 3",
                "maxLength": MAX_EXPRESSION_CHARS}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=_calculate,
        timeout_s=timeout_s,
    )
