"""A calculator MCP server (stdio), the default tool server of `env=mcp`. Needs only the `mcp` SDK.

It is started by agentrl as `python mcp_calculator.py` inside the sandbox, so it imports nothing of
agentrl: a small arithmetic evaluator over Python's own `ast`. Run it by hand to try it with any
MCP client.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

_OPS: dict[type, Callable[..., float | int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}

server = MCPServer("agentrl-calculator")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


@server.tool(description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) exactly.")
def calculator(expression: str) -> str:
    """The expression's value; an invalid expression is reported as a tool error (isError)."""
    try:
        value = _eval(ast.parse(expression, mode="eval"))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except SyntaxError as exc:
        raise ToolError(f"not a valid expression: {exc.msg}") from None
    except ValueError as exc:
        raise ToolError(str(exc)) from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


if __name__ == "__main__":
    server.run()
