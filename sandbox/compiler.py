"""Script source -> restricted code object, or line-numbered errors.

The compiler owns the ``on NAME(PARAMS):`` block syntax. It finds block
headers with :mod:`tokenize` (so a header-like line inside a string or a
comment is never taken for one), rewrites ``on`` into ``def`` on the same
line, parses, renames each block function to ``"on NAME"`` (a name with a
space, see :mod:`sandbox.policy`), runs our RestrictedPython policy and
compiles. Line numbers are always the author's; columns are 1-based.

``compile_script`` never raises for bad user code: every problem comes back
as a :class:`CompileError`.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import io
import marshal
import re
import sys
import tokenize
import types
import unicodedata
import warnings
from dataclasses import dataclass, field
from typing import Any

from sandbox.policy import CompileBudgetError, ScriptPolicy, handler_name

MAX_SOURCE_BYTES = 262144  # 256 KB, DESIGN section 5 / issue 2
#: Parsing costs time and memory per token (~600 bytes each at the peak); a
#: 250 KB script of ordinary functions has ~70,000. See also sandbox.policy.
MAX_TOKENS = 100_000
ENDPOINT_EVENT = "endpoint"
#: Errors reported for one source, and characters of one message: a source
#: of 45,000 refused names gave 45,000 errors (2.6 MB kept per remembered
#: save-time verdict, 8 MB per answer; review, session 26).
MAX_ERRORS = 20
MAX_MESSAGE_CHARS = 300
#: Marshalled code of one version (what workers load; `protocol.MAX_SHIPPED_CODE`
#: is the same): CPython writes a `finally` block's code once for every way out
#: of its `try`, so a 1.7 KB source of `try/finally` nested in `finally` blocks
#: made 7 MiB, which no worker could be sent (red-team pass, session 34).
MAX_CODE_BYTES = 2 << 20

# PEP 263 coding declaration, as tokenize matches it.
_COOKIE_RE = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.ASCII)
_BLANK_RE = re.compile(r"^[ \t\f]*(?:[#\r\n]|$)", re.ASCII)
_SKIPPED_TOKENS = frozenset({tokenize.NL, tokenize.COMMENT, tokenize.INDENT,
                             tokenize.DEDENT, tokenize.ENCODING})
# A line that could hold a header (any indentation, so misplaced ones are
# found too); only if one exists is the source tokenized.
_CANDIDATE_RE = re.compile(r"^[ \t\f]*on[ \t]+[^\W\d]", re.MULTILINE)

_C_TOKENIZER_MAX_LINE = 1000
try:  # CPython 3.11's C tokenizer iterator (private; signature changed in 3.12)
    _CTokenizerIter: Any = importlib.import_module("_tokenize").TokenizerIter
except (ImportError, AttributeError):  # pragma: no cover - other interpreters
    _CTokenizerIter = None


@dataclass(frozen=True, slots=True)
class CompileError:
    """One problem in a script: 1-based line and column, and a message."""

    line: int
    column: int
    message: str


@dataclass(frozen=True, slots=True)
class CompiledScript:
    """A compiled script: module code object and the events it handles."""

    code: types.CodeType
    events: tuple[str, ...]
    has_endpoint: bool
    # The author's source lines, used to print tracebacks.
    source_lines: tuple[str, ...] = field(default=(), repr=False)
    # Whether any function is a generator: only generators can run script
    # code after the invocation (their finally blocks, when collected), so
    # the runtime collects garbage eagerly for these scripts only.
    has_generators: bool = False


@dataclass(frozen=True, slots=True)
class CompileResult:
    """Either a script or the errors that prevented it."""

    script: CompiledScript | None
    errors: tuple[CompileError, ...]

    @property
    def ok(self) -> bool:
        """True when the script compiled."""
        return self.script is not None and not self.errors


@dataclass(slots=True)
class _Header:
    line: int
    column: int  # 0-based
    event: str


def _fail(*errors: CompileError) -> CompileResult:
    return CompileResult(None, bounded(sorted(errors, key=lambda e: (e.line, e.column))))


def bounded(errors: list[CompileError]) -> tuple[CompileError, ...]:
    """The first `MAX_ERRORS` errors, each message cut to `MAX_MESSAGE_CHARS`,
    and one more that says how many were left out."""
    kept = [e if len(e.message) <= MAX_MESSAGE_CHARS
            else CompileError(e.line, e.column, e.message[:MAX_MESSAGE_CHARS - 1] + "…")
            for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        rest = errors[MAX_ERRORS]
        kept.append(CompileError(rest.line, rest.column,
                                 f"... and {len(errors) - MAX_ERRORS} more errors from here on "
                                 "(fix the ones above first)"))
    return tuple(kept)


def _position(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _decode(source: str | bytes) -> tuple[str | None, CompileError | None]:
    """Check size and encoding; return the source text with newlines normalised."""
    if isinstance(source, str):
        try:
            data = source.encode("utf-8")
        except UnicodeEncodeError as exc:
            line, col = _position(source, exc.start)
            return None, CompileError(line, col, "source is not valid UTF-8 (lone surrogate)")
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        return None, CompileError(1, 1, "source must be text")
    if len(data) > MAX_SOURCE_BYTES:
        return None, CompileError(
            1, 1, f"source is {len(data)} bytes, over the {MAX_SOURCE_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        head = data[:exc.start]
        line = head.count(b"\n") + 1
        col = len(head) - (head.rfind(b"\n") + 1) + 1
        return None, CompileError(
            line, col, f"source is not valid UTF-8 (byte 0x{data[exc.start]:02x})")
    if text.startswith("\ufeff"):
        text = text[1:]
    # The parser treats \r\n and \r as newlines; tokenize with our readline
    # would not, so normalise once and both agree on line numbers.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text, _check_cookie(text)


def _check_cookie(text: str) -> CompileError | None:
    for number, line in enumerate(text.split("\n", 2)[:2], start=1):
        match = _COOKIE_RE.match(line)
        if match:
            name = match.group(1).lower().replace("_", "-")
            if name in ("utf-8", "utf8") or name.startswith("utf-8-"):
                return None
            return CompileError(number, 1, f'coding cookie "{match.group(1)}" is not allowed: '
                                           "scripts are UTF-8")
        if not _BLANK_RE.match(line):
            return None
    return None


def _significant_tokens(text: str) -> list[tuple[int, str, int, int]]:
    """(type, string, row, col) of the tokens that matter for headers.

    Uses CPython 3.11's C tokenizer iterator when present and no line is long
    (5x faster than the pure-Python ``tokenize`` on a 256 KB script; it emits
    no comment or NL tokens), else ``tokenize.generate_tokens``. A tokenizer error ends the
    list: the parser reports it, at the right place.
    """
    out: list[tuple[int, str, int, int]] = []
    # The C iterator copies the whole physical line into every token: quadratic
    # on a long line of many tokens (a 60,000-element list on one line: 1.4 s).
    if _CTokenizerIter is not None and max(map(len, text.split("\n"))) <= _C_TOKENIZER_MAX_LINE:
        try:
            for string, kind, row, _end_row, col, _end_col, _line in _CTokenizerIter(text):
                if kind not in _SKIPPED_TOKENS:
                    out.append((kind, string, row, col))
            return out
        except SyntaxError:
            return out
        except (TypeError, ValueError):
            out.clear()  # another interpreter's signature: use the portable path
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in _SKIPPED_TOKENS:
                out.append((tok.type, tok.string, tok.start[0], tok.start[1]))
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def _find_headers(text: str, significant: list[tuple[int, str, int, int]]
                  ) -> tuple[list[_Header], list[CompileError]]:
    """Find ``on NAME(`` at the start of logical lines, from tokens.

    Tokens, not lines: a header-like line inside a string or a comment is
    never taken for a header.
    """
    headers: list[_Header] = []
    errors: list[CompileError] = []
    if not _CANDIDATE_RE.search(text):
        return headers, errors  # no line starts with "on NAME": nothing to tokenize
    line_start = True
    for index, (kind, string, row, col) in enumerate(significant):
        starts_line, line_start = line_start, kind == tokenize.NEWLINE
        if not (starts_line and kind == tokenize.NAME and string == "on"):
            continue
        following = significant[index + 1:index + 3]
        if not following or following[0][0] != tokenize.NAME:
            continue  # `on = 1`, `on(x)`, `on.attr`: an ordinary name
        name = following[0][1]
        if len(following) < 2 or following[1][1] != "(":
            errors.append(CompileError(row, col + 1,
                                       'an "on" block header must look like "on NAME(PARAMS):"'))
            continue
        if col != 0:
            errors.append(CompileError(row, col + 1, f'"on {name}" block must start at column 0'))
        # The parser NFKC-normalises identifiers ("ｅｎｄｐｏｉｎｔ" is
        # "endpoint"); the tokenizer does not, so normalise the same way.
        headers.append(_Header(row, col, unicodedata.normalize("NFKC", name)))
    return headers, errors


def _rewrite(text: str, headers: list[_Header]) -> str:
    lines = text.split("\n")
    for header in headers:
        line = lines[header.line - 1]
        lines[header.line - 1] = line[:header.column] + "def" + line[header.column + 2:]
    return "\n".join(lines)


def _column(line: int, col0: int, header_lines: set[int]) -> int:
    """1-based author column for a 0-based column of the rewritten source."""
    if line in header_lines and col0 >= 3:
        col0 -= 1  # "def" is one character longer than "on"
    return max(col0, 0) + 1


# The policy walks the AST recursively, about five Python frames per level;
# this headroom lets ~1000-level expressions (a + b + ... is left-nested)
# through. Python-to-Python calls do not grow the C stack on 3.11.
_COMPILE_RECURSION_HEADROOM = 6000
#: What a compile that ran out of its memory budget reports.
MEMORY_MESSAGE = "script needs too much memory to compile"


def compile_script(source: str | bytes, filename: str = "<script>") -> CompileResult:
    """Compile a guild script; errors are returned, never raised."""
    old_limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(max(old_limit, _stack_depth() + _COMPILE_RECURSION_HEADROOM))
        return _compile(source, filename)
    except RecursionError:
        return _fail(CompileError(1, 1, "script is nested too deeply to compile"))
    except MemoryError:
        return _fail(CompileError(1, 1, MEMORY_MESSAGE))
    except Exception as exc:  # noqa: BLE001 - the contract: bad code never raises
        return _fail(CompileError(1, 1, f"the script could not be compiled ({type(exc).__name__})"))
    finally:
        sys.setrecursionlimit(old_limit)


def _stack_depth() -> int:
    depth = 0
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def _compile(source: str | bytes, filename: str) -> CompileResult:
    text, error = _decode(source)
    if error is not None or text is None:
        return _fail(error or CompileError(1, 1, "source could not be read"))
    if "\x00" in text:
        return _fail(CompileError(*_position(text, text.index("\x00")),
                                  "source contains a null byte"))
    significant = _significant_tokens(text)
    if len(significant) > MAX_TOKENS:
        row = significant[MAX_TOKENS][2]
        return _fail(CompileError(row, 1, f"script is too large to compile: more than "
                                          f"{MAX_TOKENS} tokens (names, numbers, operators, "
                                          "...); keep data out of the source"))
    headers, errors = _find_headers(text, significant)
    if errors:
        # A malformed or misplaced header would also come back from the
        # parser as a less helpful syntax error; report ours alone.
        return _fail(*errors)
    header_lines = {h.line for h in headers}
    rewritten = _rewrite(text, headers)
    with warnings.catch_warnings():
        # SyntaxWarning/DeprecationWarning would be printed (or raised when
        # warnings are errors); they are not the author's errors.
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(rewritten, filename, "exec")
        except MemoryError:
            # What the parser raises for nesting past its own stack (or a
            # memory cap: the caller knows which; see MEMORY_MESSAGE).
            return _fail(CompileError(1, 1, "script is nested too deeply to compile"))
        except SyntaxError as exc:
            errors.append(_syntax_error(exc, header_lines))
            return _fail(*errors)
        errors.extend(_name_blocks(tree, headers))
        policy = ScriptPolicy()
        try:
            tree = policy.visit(tree)  # type: ignore[assignment]
        except CompileBudgetError as exc:
            line = exc.line
            return _fail(CompileError(line, _column(line, exc.col_offset, header_lines),
                                      exc.message))
        for found in policy.located_errors:
            line = found.line or 1
            errors.append(CompileError(line, _column(line, found.col_offset or 0, header_lines),
                                       found.message))
        if errors:
            return _fail(*errors)
        try:
            code = compile(tree, filename, "exec", dont_inherit=True)
        except SyntaxError as exc:
            return _fail(_syntax_error(exc, header_lines))
    size = len(marshal.dumps(code))
    if size > MAX_CODE_BYTES:
        return _fail(CompileError(1, 1, f"script compiles to {size / (1 << 20):.1f} MiB of "
                                        f"bytecode, over the {MAX_CODE_BYTES >> 20} MiB limit: "
                                        "a finally block is compiled once for every way out of "
                                        "its try, so nested try/finally blocks multiply it"))
    events = tuple(dict.fromkeys(h.event for h in headers))
    return CompileResult(CompiledScript(code, events, ENDPOINT_EVENT in events,
                                        tuple(text.split("\n")), _has_generators(code)), ())


_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _has_generators(code: types.CodeType) -> bool:
    if code.co_flags & _SUSPENDABLE:
        return True
    return any(isinstance(const, types.CodeType) and _has_generators(const)
               for const in code.co_consts)


def _syntax_error(exc: SyntaxError, header_lines: set[int]) -> CompileError:
    line = exc.lineno or 1
    col0 = (exc.offset or 1) - 1
    return CompileError(line, _column(line, col0, header_lines),
                        f"{type(exc).__name__}: {exc.msg}")


def _takes_one_argument(args: ast.arguments) -> bool:
    """Whether a function with these parameters can be called as f(event)."""
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    kw_required = any(default is None for default in args.kw_defaults)
    return (positional >= 1 or args.vararg is not None) and required <= 1 and not kw_required


def _name_blocks(tree: ast.Module, headers: list[_Header]) -> list[CompileError]:
    """Rename each top-level block function and check the block rules."""
    errors: list[CompileError] = []
    by_line = {h.line: h for h in headers if h.column == 0}
    endpoint_line: int | None = None
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.lineno not in by_line:
            continue
        header = by_line[node.lineno]
        if node.col_offset != 0 or node.name != header.event:
            continue
        if node.decorator_list:
            errors.append(CompileError(node.decorator_list[0].lineno, 1,
                                       f'"on {header.event}" blocks cannot be decorated'))
        if header.event == ENDPOINT_EVENT:
            if not _takes_one_argument(node.args):
                errors.append(CompileError(node.lineno, 1, 'the "on endpoint" block takes one '
                                                           "parameter, the event"))
            if endpoint_line is not None:
                errors.append(CompileError(node.lineno, 1, 'duplicate "on endpoint" block '
                                                           f"(first one on line {endpoint_line})"))
            else:
                endpoint_line = node.lineno
        node.name = handler_name(header.event)
    return errors
