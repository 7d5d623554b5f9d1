"""The built-in `calculator` tool (`env.tools=calculator`): exact integer arithmetic.

Job: `calculate(expr)` evaluates + - * / and parentheses over non-negative
integer literals with a small recursive-descent parser (never `eval`), exactly
(`fractions.Fraction`); `calculator(expression)` is the same as a tool the
model calls in its chat template's format. The calculator environment
(`envs.tool.CalcEnv`, `<calc>` tags in raw text) calls it too.

Invariant: any input either evaluates or raises `CalcError` (bounded length and
nesting: no input can exhaust the recursion or the memory).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["CalcError", "calculate", "calculator"]

MAX_EXPR_CHARS = 200
MAX_DEPTH = 32  # parentheses nesting; bounds the parser's recursion

_LEXEME = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")


class CalcError(ValueError):
    """The expression is not valid integer arithmetic, or divides by zero."""


def _lex(expr: str) -> list[str]:
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _LEXEME.match(expr, pos)
        if m is None:
            raise CalcError(f"unexpected character {expr[pos:].lstrip()[:1]!r}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise CalcError("empty expression")
    return tokens


class _Parser:
    """Recursive descent: expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*;
    unary := ('+'|'-') unary | INT | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def unary(self) -> Fraction:
        tok = self.take()
        if tok in ("+", "-"):
            self._enter()
            value = self.unary()
            self.depth -= 1
            return value if tok == "+" else -value
        if tok == "(":
            self._enter()
            value = self.expr()
            if self.take() != ")":
                raise CalcError("expected ')'")
            self.depth -= 1
            return value
        if tok.isdigit():
            return Fraction(int(tok))
        raise CalcError(f"unexpected {tok!r}")

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"nesting deeper than {MAX_DEPTH}")


def calculate(expr: str) -> str:
    """Evaluates integer arithmetic with + - * / and parentheses, exactly.

    Division is exact: a non-integral result is written as a reduced fraction
    ("7/2"). Only non-negative integer literals, the four operators, unary
    signs, parentheses and whitespace are accepted.

    Returns:
        The value as text ("84", "-3", "7/2").

    Raises:
        CalcError: anything else (names, floats, '**', unbalanced parentheses,
            division by zero, over-long or over-nested input).
    """
    parser = _Parser(_lex(expr))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalcError(f"unexpected {parser.peek()!r}")
    return str(value.numerator) if value.denominator == 1 else str(value)




def calculator(expression: str) -> str:
    """Evaluates integer arithmetic exactly: + - * / and parentheses over whole
    numbers. A division that does not come out even gives a fraction ("7/2").

    Args:
        expression: The arithmetic expression, for example "(12 + 3) * 4".
    """
    return calculate(expression)
