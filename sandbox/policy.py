"""Our RestrictedPython policy: the syntax a script may use.

RestrictedPython's transformer denies every AST node without a ``visit_``
method, rejects names and attributes starting with ``_`` and rewrites
attribute/item/iteration/print into calls of the guards in
``sandbox.guards``. This subclass keeps that deny-by-default base and

* records each error with its node's line *and* column (the base class only
  keeps a ``"Line N: ..."`` string), so the compiler can report both;
* rejects ``except*`` with its own message (CVE-2025-22153, and it crashes
  CPython 3.11's compiler in some forms);
* rejects the legacy ``printed`` name (print output is captured by the
  runtime instead);
* lets the compiler-generated ``on`` block functions through (their names
  contain a space, which no source text can produce).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from RestrictedPython.transformer import RestrictingNodeTransformer

# Prefix of the function names the compiler gives ``on NAME(...)`` blocks.
# "on endpoint" contains a space: it is a valid name for the AST and the code
# object but can never be written in source, so a script can neither define,
# shadow nor look up a handler by name.
HANDLER_PREFIX = "on "


def handler_name(event: str) -> str:
    """The global name under which the ``on EVENT`` block is stored."""
    return HANDLER_PREFIX + event


@dataclass(frozen=True, slots=True)
class PolicyError:
    """A rejection found by the policy: 1-based line, 0-based column."""

    line: int | None
    col_offset: int | None
    message: str


# What makes compiling explode, bounded before CPython's compiler runs (redteam
# finding 5; the compiler bounds the number of tokens). CPython 3.11 compiles N
# equal code objects (``f = lambda: 0`` on N lines) in O(N**2): 20,000 took
# 10-20 s, 2,000 take ~0.1 s.
MAX_CODE_OBJECTS = 2000
MAX_NESTING = 1000
_CODE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
               ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class CompileBudgetError(Exception):
    """The script is past one of the bounds above; compiling it stops at once."""

    def __init__(self, node: ast.AST, message: str) -> None:
        super().__init__(message)
        self.line: int = getattr(node, "lineno", 1) or 1
        self.col_offset: int = getattr(node, "col_offset", 0) or 0
        self.message = message


class ScriptPolicy(RestrictingNodeTransformer):
    """Deny-by-default transformer for guild scripts."""

    def __init__(self, errors: list[str] | None = None, warnings: list[str] | None = None,
                 used_names: dict[str, bool] | None = None) -> None:
        super().__init__(errors, warnings, used_names)
        self.located_errors: list[PolicyError] = []
        self._code_objects = 0
        self._depth = 0

    def visit(self, node: ast.AST) -> ast.AST:
        """Count code objects and nesting; raise CompileBudgetError past a bound."""
        if isinstance(node, _CODE_NODES):
            self._code_objects += 1
            if self._code_objects > MAX_CODE_OBJECTS:
                raise CompileBudgetError(node, "script takes too long to compile: more than "
                                               f"{MAX_CODE_OBJECTS} functions, lambdas, classes "
                                               "and comprehensions")
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                raise CompileBudgetError(node, "script is nested too deeply to compile")
            return super().visit(node)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def error(self, node: ast.AST, info: str) -> None:
        """Record an error with its position (and keep the base class's list)."""
        super().error(node, info)
        self.located_errors.append(PolicyError(
            getattr(node, "lineno", None), getattr(node, "col_offset", None), info))

    def visit_TryStar(self, node: ast.AST) -> None:
        """``try/except*`` is refused: CVE-2025-22153 type confusion."""
        self.error(node, '"except*" (exception groups) is not allowed.')

    def visit_Name(self, node: ast.Name) -> ast.AST:
        """Refuse ``printed``; otherwise RestrictedPython's name checks."""
        if node.id == "printed":
            self.error(node, '"printed" is a reserved name.')
            return node
        return super().visit_Name(node)  # type: ignore[return-value]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        """Check generated handler names ourselves; the base checks the rest."""
        if node.name.startswith(HANDLER_PREFIX):
            # The compiler validated the event name; hide the prefix from the
            # base class's name check, then restore it.
            generated = node.name
            node.name = generated[len(HANDLER_PREFIX):]
            result = super().visit_FunctionDef(node)
            node.name = generated
            return result  # type: ignore[return-value]
        return super().visit_FunctionDef(node)  # type: ignore[return-value]
