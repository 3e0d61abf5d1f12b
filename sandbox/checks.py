"""Save-time checks: static findings on a script that compiles, with line and column.

The compiler (:mod:`sandbox.compiler`) decides whether a script *can* run;
these checks find what would fail, or never run, once it does, so the author
hears about it at save time instead of from a client's 500 or 501:

errors (the save is refused, like a syntax error)
    * an empty script (nothing but blanks and comments);
    * ``import X`` / ``from X import y`` of a module outside the allowed list
      (read from :data:`sandbox.modules.ALLOWED_MODULES`), relative imports;
    * a call of a name that nothing in the script defines and that is not a
      builtin scripts have (``open(...)``, ``eval(...)``, ``prnt(...)``);
    * a name an allowed module does not offer: ``from json import lodas``, or
      ``json.lodas`` where ``json`` is bound only by its import.

warnings (the save goes through; the front shows them, the script keeps them)
    * no ``on endpoint`` block: every call of the endpoint answers 501;
    * an ``on NAME`` block for an event this service never emits.

Everything here reads the source and its syntax tree only; nothing runs.
"""
from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass

from sandbox.guards import BASE_BUILTINS
from sandbox.modules import ALLOWED_MODULES, STATIC_NAMESPACES, make_random_namespace, namespace_has

#: The events this service delivers to scripts.
EMITTED_EVENTS: frozenset[str] = frozenset({"endpoint"})
# Names a script may call without defining them: the curated builtins plus
# `print`, which the compiler rewrites into the runtime's collector.
_KNOWN_BUILTINS: frozenset[str] = frozenset(BASE_BUILTINS) | {"print"}
# The compiler's own header syntax, at column 0 (it refuses any other column).
_HEADER_RE = re.compile(r"^on([ \t]+)([^\W\d]\w*)([ \t]*)\(", re.MULTILINE)
ERROR, WARNING = "error", "warning"


@dataclass(frozen=True, slots=True)
class Finding:
    """One finding: 1-based line and column, message, `error` or `warning`."""

    line: int
    column: int
    message: str
    severity: str

    def to_dict(self) -> dict[str, object]:
        return {"line": self.line, "column": self.column, "message": self.message,
                "severity": self.severity}


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The findings of one source, errors and warnings apart, in source order."""

    errors: tuple[Finding, ...]
    warnings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """True when nothing refuses the save."""
        return not self.errors


def _parse(text: str) -> tuple[ast.Module, dict[int, str]] | None:
    """The tree with each ``on`` header read as ``def``; None when it does not parse
    (the compiler reports that)."""
    headers: dict[int, str] = {}

    def as_def(match: re.Match[str]) -> str:
        headers[text.count("\n", 0, match.start()) + 1] = match.group(2)
        return "def" + match.group(1) + match.group(2) + match.group(3) + "("

    rewritten = _HEADER_RE.sub(as_def, text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(rewritten, "<script>", "exec"), headers
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None


def _column(node: ast.AST, line: int, headers: dict[int, str]) -> int:
    col = getattr(node, "col_offset", 0) or 0
    if line in headers and col >= 3:
        col -= 1            # "def" is one character longer than "on"
    return col + 1


def _bound_names(tree: ast.Module, with_imports: bool = True) -> set[str]:
    """Every name the script binds anywhere (any scope): a call of one of these
    may resolve, so only names bound nowhere are reported."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias) and with_imports:
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound


def _offers(module: str, name: str) -> bool:
    """Whether the script's `module` has `name` (the runtime's namespaces decide)."""
    ns = STATIC_NAMESPACES.get(module)
    if ns is None:
        ns = make_random_namespace() if module == "random" else None
    return ns is None or namespace_has(ns, name)


def _import_only_names(tree: ast.Module) -> dict[str, str]:
    """Names bound by `import MODULE [as NAME]` of an allowed module and by nothing
    else: their attributes are exactly the module's members."""
    imported: dict[str, str] = {}
    other: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ALLOWED_MODULES:
                    name = alias.asname or alias.name
                    if imported.get(name, alias.name) != alias.name:
                        other.add(name)
                    imported[name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            other.update(a.asname or a.name for a in node.names)
    plain = _bound_names(tree, with_imports=False)
    return {k: v for k, v in imported.items() if k not in other and k not in plain}


def check_source(text: str) -> CheckReport:
    """Run every save-time check on `text` (a script the compiler accepted)."""
    errors: list[Finding] = []
    found: list[Finding] = []
    if not text.strip() or all(not line.strip() or line.lstrip().startswith("#")
                               for line in text.splitlines()):
        return CheckReport((Finding(1, 1, 'script is empty: add an "on endpoint(event):" block',
                                    ERROR),), ())
    parsed = _parse(text)
    if parsed is None:
        return CheckReport((), ())
    tree, headers = parsed

    def add(node: ast.AST, message: str, severity: str) -> None:
        line = getattr(node, "lineno", 1) or 1
        (errors if severity == ERROR else found).append(
            Finding(line, _column(node, line, headers), message, severity))

    allowed = ", ".join(sorted(ALLOWED_MODULES))
    bound = _bound_names(tree)
    modules = _import_only_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED_MODULES or "." in alias.name:
                    add(node, f"import of {alias.name!r} is not allowed (allowed: {allowed})", ERROR)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                add(node, "relative imports are not allowed", ERROR)
            elif (node.module or "") not in ALLOWED_MODULES:
                add(node, f"import of {node.module!r} is not allowed (allowed: {allowed})", ERROR)
            else:
                for alias in node.names:
                    if alias.name != "*" and not _offers(node.module or "", alias.name):
                        add(node, f"module {node.module!r} has no {alias.name!r}", ERROR)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in modules and not node.attr.startswith("_")
              and not _offers(modules[node.value.id], node.attr)):
            add(node, f"module {modules[node.value.id]!r} has no {node.attr!r}", ERROR)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id not in bound and node.func.id not in _KNOWN_BUILTINS
              and not node.func.id.startswith("_")):      # the policy reports "_" names
            add(node.func, f"{node.func.id}() is not defined in the script and is not a "
                           "builtin scripts can use", ERROR)

    events = {line: name for line, name in headers.items()}
    handlers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.lineno in events]
    if not any(n.name == "endpoint" for n in handlers):
        found.append(Finding(1, 1, 'no "on endpoint(event):" block: every call of this '
                                   "script's endpoint will answer 501 no_endpoint_handler", WARNING))
    for node in handlers:
        if node.name not in EMITTED_EVENTS:
            add(node, f'"on {node.name}" never runs here: this service only emits '
                      f'{", ".join(sorted(EMITTED_EVENTS))}', WARNING)
    order = lambda f: (f.line, f.column)   # noqa: E731
    return CheckReport(tuple(sorted(errors, key=order)), tuple(sorted(found, key=order)))
