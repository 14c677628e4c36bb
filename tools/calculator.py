"""`calculator`: exact arithmetic on an expression, without executing any code.

The expression is parsed with Python's `ast` and only numbers, parentheses and the operators
+ - * / // % ** (and unary minus) are evaluated, with integers kept exact and a bound on the size
of powers, so a model cannot use it to run code or exhaust memory. It is the tool of the built-in
`arithmetic` environment; for running real programs use the sandboxed `python` tool.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from agentrl.errors import ToolArgumentError
from agentrl.tools.core import tool

__all__ = ["calculator", "evaluate_expression"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_EXPONENT = 512
_MAX_DIGITS = 4000
_MAX_LENGTH = 2000


def evaluate_expression(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raise ToolArgumentError saying what is wrong."""
    if len(expression) > _MAX_LENGTH:
        raise ToolArgumentError(f"Expression is {len(expression)} characters; the limit is {_MAX_LENGTH}.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolArgumentError(
            f"Cannot parse {expression!r} as arithmetic ({exc.msg}). "
            "Use numbers, parentheses and + - * / // % **, for example '(12 + 3) * 4'."
        ) from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        constant = node.value
        if isinstance(constant, (int, float)) and not isinstance(constant, bool):
            return Fraction(constant)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolArgumentError("Division by zero.")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1:
                raise ToolArgumentError("Only whole-number exponents are supported.")
            if abs(right) > _MAX_EXPONENT:
                raise ToolArgumentError(f"Exponent {right} is too large (limit {_MAX_EXPONENT}).")
            if left == 0 and right < 0:
                raise ToolArgumentError("Zero cannot be raised to a negative power.")
        value = _BINARY[type(node.op)](left, right)
        value = Fraction(value)
        if len(str(value.numerator)) > _MAX_DIGITS:
            raise ToolArgumentError(f"The result has more than {_MAX_DIGITS} digits.")
        return value
    raise ToolArgumentError(
        f"Unsupported element '{ast.unparse(node) if hasattr(ast, 'unparse') else type(node).__name__}': "
        "only numbers, parentheses and + - * / // % ** are allowed."
    )


def format_number(value: Fraction) -> str:
    """An integer as digits, any other value as a decimal with up to 10 significant places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


@tool
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: The expression, e.g. "(1234 * 5678) - 91". Supports + - * / // % ** and
            parentheses.
    """
    # Bounded work (length, exponent and digit caps), so it runs inline rather than in a thread.
    return format_number(evaluate_expression(expression))
