"""Mutation sites of one Python source: plausible one-line bugs, found on the AST and applied
as byte-exact text edits (the rest of the file, comments and line numbers included, stays).

Operators: a comparison flipped (``<``/``<=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not
in``), an arithmetic or bitwise operator swapped, ``and``/``or`` swapped, a ``not`` dropped, an
``if``/``while`` condition negated, a number off by one, a boolean flipped, ``return x`` made
``return None``, a call statement deleted, ``break``/``continue`` swapped.  Docstrings, logging
calls, ``__all__``, annotations and lines marked ``# pragma: no mutate`` are never mutated.
"""
from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["Mutant", "find_mutants", "apply", "describe"]

_CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
        ast.Eq: ("==", "!="), ast.NotEq: ("!=", "==")}
_BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.Div: ("/", "*"),
        ast.FloorDiv: ("//", "*"), ast.Mod: ("%", "//"), ast.BitAnd: ("&", "|"),
        ast.BitOr: ("|", "&"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"),
        ast.Pow: ("**", "*")}
_LOG_NAMES = {"log", "_log", "logger", "_logger", "logging", "LOG", "_LOG"}


@dataclass(frozen=True)
class Mutant:
    """One planted bug: where (``line``, ``func``), what (``op``: ``before`` → ``after``, the text
    of the byte range ``start``..``end``), and a stable ``id`` that survives unrelated edits."""
    id: str
    line: int
    func: str
    op: str
    before: str
    after: str
    start: int            # byte offsets into the source
    end: int


def apply(source: bytes, m: Mutant) -> bytes:
    """The source with mutant ``m`` planted."""
    assert source[m.start:m.end].decode() == m.before, (m, source[m.start:m.end])
    return source[:m.start] + m.after.encode() + source[m.end:]


class _Finder(ast.NodeVisitor):
    def __init__(self, src: bytes, funcs: Optional[Sequence[str]]):
        self.src = src
        self.lines = src.splitlines(keepends=True)
        self.offsets = [0]
        for ln in self.lines:
            self.offsets.append(self.offsets[-1] + len(ln))
        self.funcs = funcs
        self.stack: List[str] = []
        self.raw: List[Tuple[int, int, int, str, str, str, str]] = []
        self.tokens = list(tokenize.tokenize(io.BytesIO(src).readline))
        self.skip_lines = {i + 1 for i, ln in enumerate(self.lines) if b"pragma: no mutate" in ln}

    # positions -------------------------------------------------------------------------------
    def pos(self, line: int, col: int) -> int:
        return self.offsets[line - 1] + col

    def span(self, n: ast.AST) -> Tuple[int, int]:
        return (self.pos(n.lineno, n.col_offset), self.pos(n.end_lineno, n.end_col_offset))

    def tok_between(self, a: int, b: int, text: str) -> Optional[Tuple[int, int]]:
        """Byte span of the operator token ``text`` (possibly two words) between offsets."""
        words = text.split()
        toks = [t for t in self.tokens if t.type in (tokenize.OP, tokenize.NAME)
                and a <= self.tok_pos(t) and self.tok_pos(t, end=True) <= b]
        for i in range(len(toks) - len(words) + 1):
            if [t.string for t in toks[i:i + len(words)]] == words:
                return self.tok_pos(toks[i]), self.tok_pos(toks[i + len(words) - 1], end=True)
        return None

    def tok_pos(self, t: tokenize.TokenInfo, end: bool = False) -> int:
        line, col = t.end if end else t.start
        # tokenize columns are str offsets of the decoded line; convert to bytes
        text = self.lines[line - 1].decode("utf-8")
        return self.offsets[line - 1] + len(text[:col].encode("utf-8"))

    def add(self, node: ast.AST, a: int, b: int, op: str, after: str) -> None:
        if not self.stack or (self.funcs is not None and not self._wanted()):
            return
        if getattr(node, "lineno", 0) in self.skip_lines:
            return
        before = self.src[a:b].decode()
        if before == after:
            return
        self.raw.append((a, b, node.lineno, op, before, after, ".".join(self.stack)))

    def _wanted(self) -> bool:
        q = ".".join(self.stack)
        return any(q == f or q.startswith(f + ".") or self.stack[-1] == f for f in self.funcs)

    # scopes ----------------------------------------------------------------------------------
    def _scope(self, node: ast.AST, name: str) -> None:
        self.stack.append(name)
        body = getattr(node, "body", [])
        for i, child in enumerate(body):
            if i == 0 and isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) \
                    and isinstance(child.value.value, str):
                continue                                   # docstring
            self.visit(child)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.stack.append(node.name)
            self.visit(d)
            self.stack.pop()
        self._scope(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.stack.append("<lambda>")               # module-level tables of formulas count
        self.visit(node.body)
        self.stack.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope(node, node.name)

    # skipped -----------------------------------------------------------------------------------
    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return                                             # messages

    def visit_Assert(self, node: ast.Assert) -> None:
        return

    # operators ---------------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        prev = node.left
        for op, right in zip(node.ops, node.comparators):
            a, b = self.span(prev)[1], self.span(right)[0]
            if type(op) in _CMP:
                old, new = _CMP[type(op)]
                self._tok(node, a, b, old, new, "cmp")
            elif isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                old = {ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
                       ast.NotIn: "not in"}[type(op)]
                new = {"is": "is not", "is not": "is", "in": "not in", "not in": "in"}[old]
                self._tok(node, a, b, old, new, "cmp")
            prev = right
        self.generic_visit(node)

    def _tok(self, node: ast.AST, a: int, b: int, old: str, new: str, op: str) -> None:
        s = self.tok_between(a, b, old)
        if s is not None:
            self.add(node, s[0], s[1], op, new)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in _BIN and not self._is_str_format(node):
            old, new = _BIN[type(node.op)]
            self._tok(node, self.span(node.left)[1], self.span(node.right)[0], old, new, "arith")
        self.generic_visit(node)

    @staticmethod
    def _is_str_format(node: ast.BinOp) -> bool:
        return isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
            and isinstance(node.left.value, str)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if type(node.op) in _BIN:
            old, new = _BIN[type(node.op)]
            self._tok(node, self.span(node.target)[1], self.span(node.value)[0], old + "=",
                      new + "=", "arith")
        self.visit(node.value)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:]):
            self._tok(node, self.span(left)[1], self.span(right)[0], old, new, "bool")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        a, b = self.span(node)
        if isinstance(node.op, ast.Not):
            self.add(node, a, b, "not", self.src[self.span(node.operand)[0]:b].decode())
        elif isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            self.add(node, a, self.span(node.operand)[0], "sign", "")
        self.generic_visit(node)

    def _negate(self, node: ast.AST, test: ast.expr) -> None:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return                                  # the dropped `not` is this mutant
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(
                test.ops[0], (ast.Is, ast.IsNot, ast.In, ast.NotIn, ast.Eq, ast.NotEq)):
            return                                  # the flipped comparison is this mutant
        a, b = self.span(test)
        self.add(node, a, b, "cond", f"not ({self.src[a:b].decode()})")

    def visit_If(self, node: ast.If) -> None:
        self._negate(node, node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        if not (isinstance(node.test, ast.Constant) and node.test.value is True):
            self._negate(node, node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate(node, node.test)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        a, b = self.span(node)
        v = node.value
        if isinstance(v, bool):
            self.add(node, a, b, "const", str(not v))
        elif isinstance(v, int):
            self.add(node, a, b, "const", str(v + 1) if v != 1 else "0")
        elif isinstance(v, float):
            self.add(node, a, b, "const", repr(v * 2 if v else 1.0))

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant)
                                           and node.value.value is None):
            a, b = self.span(node)
            self.add(node, a, b, "return", "return None")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call) and not self._is_log(node.value):
            a, b = self.span(node)
            self.add(node, a, b, "delete", "pass")
            self.generic_visit(node)
        elif not isinstance(node.value, ast.Call):
            self.generic_visit(node)

    @staticmethod
    def _is_log(call: ast.Call) -> bool:
        f = call.func
        while isinstance(f, ast.Attribute):
            if isinstance(f.value, ast.Name) and f.value.id in _LOG_NAMES:
                return True
            f = f.value
        return isinstance(f, ast.Name) and f.id in ("print", "warn")

    def visit_Break(self, node: ast.Break) -> None:
        self.add(node, *self.span(node), "flow", "continue")

    def visit_Continue(self, node: ast.Continue) -> None:
        self.add(node, *self.span(node), "flow", "break")

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        self.generic_visit(node)


def find_mutants(source: bytes, funcs: Optional[Sequence[str]] = None) -> List[Mutant]:
    """Every mutant of ``source`` inside functions and methods (module level is configuration),
    restricted to the functions named in ``funcs`` (a name, ``Class.method`` or ``Class``)."""
    f = _Finder(source, funcs)
    f.visit(ast.parse(source))
    out: List[Mutant] = []
    seen: Dict[Tuple[str, str, str, str], int] = {}
    for a, b, line, op, before, after, func in sorted(set(f.raw)):
        key = (func, op, before, after)
        k = seen[key] = seen.get(key, -1) + 1
        mid = hashlib.sha1(repr((func, op, before, after, k)).encode()).hexdigest()[:10]
        out.append(Mutant(mid, line, func, op, before, after, a, b))
    # a mutant must still compile (e.g. a deleted call that was the only statement stays `pass`)
    return [m for m in out if _compiles(apply(source, m))]


def _compiles(src: bytes) -> bool:
    try:
        compile(src, "<mutant>", "exec")
        return True
    except SyntaxError:
        return False


def describe(ms: Iterable[Mutant]) -> str:
    """One line per mutant, for listings."""
    return "\n".join(f"{m.id} {m.line:5d} {m.func:24s} {m.op:7s} {m.before!r} -> {m.after!r}"
                     for m in ms)
