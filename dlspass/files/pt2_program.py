"""What the program of a ``.pt2`` (``models/model.json``) may name before torch reads it: call
targets, symbolic expressions and shape guards.

torch's deserializer resolves a call target by dotted path with ``getattr`` anywhere under
``torch``, ``operator`` and ``math``; it passes every symbolic expression (``expr_str``) to
``sympy.sympify``, which evaluates Python, in time that grows with nesting and, for
``Max``/``Min``, with the square of the arguments; ``ExportedProgram.module()`` ``exec``s the
guards. ``target_refusal`` and ``guard_refusal`` say why one is refused (or None);
``ExpressionBudget`` does the same for the expressions of one program, whose cost it also
bounds in total.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

import torch
from torch._export.serde.serialize import _SYM_OPS

from dlspass.files.bounded_text import excerpt

# A call target: an operator overload, a higher-order op (of _HOPS), or a symbolic-shape op.
_TARGET = re.compile(r"(torch\.ops\.\w+\.\w+(\.\w+)?|torch\.\w+|_operator\.\w+|math\.\w+)")
# A symbolic expression: numbers, symbol names (s0, u3, zuf0), the torch/sympy functions below,
# arithmetic and comparisons. No quotes, attributes, subscripts or powers: nothing that
# sympify's eval could turn into a call of a Python builtin or an exponential computation.
_IDENTIFIER = re.compile(r"[A-Za-z_]\w{0,199}")
# Symbolic sizes as torch writes them (sympy's srepr): "Mul(Integer(2), Symbol('s0',
# positive=True, integer=True))". Left out because they compute without bound on small
# literals: powers (Pow(9, 10**9)), LShift, RoundDecimal; keyword values are capped (a Float's
# precision=10**18 would too).
_EXPR_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Half", "One", "Zero", "NegativeOne", "Infinity",
    "NegativeInfinity", "oo", "true", "false", "BooleanTrue", "BooleanFalse",
    "Add", "Mul", "Mod", "Max", "Min", "Abs", "floor", "ceiling", "Eq", "Ne", "Lt", "Le", "Gt",
    "Ge", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Equality",
    "Unequality", "And", "Or", "Not",
    # torch.utils._sympy.functions, as ExportedProgramDeserializer maps them (no powers)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "RShift", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt",
    "ToFloat", "Identity",
})
# Left out, with the operators of _EFFECTS: ``print`` (torch formats its string with
# ``str.format``, whose fields reach attributes and globals of its arguments: a secret printed by
# any command that runs or re-traces the graph) and ``with_effects``, which runs such operators.
_HOPS = frozenset({
    "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan",
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "invoke_subgraph", "auto_functionalized",
    "auto_functionalized_v2", "flex_attention", "flex_attention_backward",
    "out_dtype", "run_const_graph", "hints_wrapper", "_export_tracepoint",
})
# Operator overloads whose effect is output, not a tensor (aten::_print writes its string).
_EFFECTS = frozenset({"aten::_print"})
MAX_EXPR_CHARS = 4096
"""Longest symbolic expression or guard."""
MAX_GUARDS = 10_000
"""Most guards of one program."""
MAX_EXPR_DEPTH = 32
"""Deepest nesting of calls in one symbolic expression."""
MAX_EXPR_ARGS = 32
"""Most positional arguments of one call in a symbolic expression."""
MAX_MINMAX_ARGS = 8
"""Most arguments of one ``Max``/``Min`` after sympy flattens nested ones: sympy compares them
pairwise through its assumptions (64 symbols take seconds, 600 minutes)."""
MAX_MINMAX_PAIRS = 1024
"""Most ``Max``/``Min`` argument pairs over the distinct expressions of one program."""
MAX_EXPR_TOTAL_CHARS = 2 * 2**20
"""Most characters of symbolic expressions in one program (sympify parses ~0.1 MB/s)."""


def _ast_grammar() -> tuple[type, ...]:
    return (ast.Expression, ast.Compare, ast.BinOp, ast.BoolOp, ast.UnaryOp, ast.Subscript,
            ast.Call, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
            ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or, ast.Not,
            ast.USub, ast.UAdd)


_AST_GRAMMAR = _ast_grammar()
# Shape guards as torch.export writes them: "(L['x'].size()[0] % 2) == 0" (run in a namespace
# of sympy's interpreter names).
_GUARD_NAMES = frozenset({"L", "Max", "Min", "Mod", "FloorDiv", "CeilToInt", "FloorToInt",
                          "math", "floor", "ceiling", "Abs"})
_GUARD_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "floor", "ceil", "trunc"})


def target_refusal(target: Any) -> str | None:
    """Why ``target`` is not a call target torch may resolve, or None."""
    if not isinstance(target, str) or not _TARGET.fullmatch(target):
        return f"call target {excerpt(target, 80)} is not an operator"
    if not _is_operator(_resolve_target(target)):
        return f"call target {excerpt(target, 80)} is not an operator (running the graph would call it)"
    return None


def guard_refusal(guard: Any) -> str | None:
    """Why ``guard`` is not a shape guard, or None. ``ExportedProgram.module()`` pastes it into
    Python source and ``exec``s it, and again inside a string literal, so only size
    comparisons pass."""
    if not _python_subset(guard, _GUARD_NAMES, _GUARD_ATTRS, keywords=False):
        return (f"guard {excerpt(guard, 80)} is not a shape comparison "
                "(ExportedProgram.module() would execute it as Python)")
    return None


class ExpressionBudget:
    """The symbolic expressions of one program: each bounded in grammar, nesting and arity,
    all of them in text (``MAX_EXPR_TOTAL_CHARS``) and in ``Max``/``Min`` argument pairs
    over the distinct ones (``MAX_MINMAX_PAIRS``)."""
    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.chars = 0
        self.minmax_pairs = 0

    def refusal(self, expr: Any) -> str | None:
        """Why ``expr`` (a symbolic size in ``srepr`` form) is refused, or None; counts it."""
        if not _python_subset(expr, _EXPR_NAMES, frozenset(), keywords=True):
            return (f"symbolic expression {excerpt(expr, 80)} is not a sympy size "
                    "expression (sympify would evaluate it as Python)")
        self.chars += len(expr)
        if self.chars > MAX_EXPR_TOTAL_CHARS:
            return (f"its symbolic expressions total more than {MAX_EXPR_TOTAL_CHARS:,} "
                    "characters (sympify would take minutes)")
        if expr in self.seen:
            return None  # sympy caches what it built for the same text
        self.seen.add(expr)
        why, pairs = _expr_cost(expr)
        if why is not None:
            return f"symbolic expression {excerpt(expr, 80)} {why} (sympify would take unbounded time)"
        self.minmax_pairs += pairs
        if self.minmax_pairs > MAX_MINMAX_PAIRS:
            return (f"its symbolic expressions compare more than {MAX_MINMAX_PAIRS:,} "
                    "Max/Min argument pairs (sympify would take minutes)")
        return None


def _expr_cost(expr: str) -> tuple[str | None, int]:
    """Why the (grammatical) expression costs too much to sympify, or None; and the number
    of ``Max``/``Min`` argument pairs sympy will compare."""
    tree = ast.parse(expr, mode="eval")
    pairs = 0
    stack: list[tuple[ast.AST, int]] = [(tree.body, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, ast.Call):
            depth += 1
            if depth > MAX_EXPR_DEPTH:
                return f"nests calls more than {MAX_EXPR_DEPTH} deep", pairs
            if len(node.args) > MAX_EXPR_ARGS:
                return f"passes {len(node.args)} arguments to one call (more than {MAX_EXPR_ARGS})", pairs
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in ("Max", "Min"):
                n = _flat_args(node, name)
                if n > MAX_MINMAX_ARGS:
                    return f"takes the {name} of {n} values (more than {MAX_MINMAX_ARGS})", pairs
                pairs += n * (n - 1) // 2
        stack.extend((child, depth) for child in ast.iter_child_nodes(node))
    return None, pairs


def _flat_args(call: ast.Call, name: str) -> int:
    """The arguments of a ``Max``/``Min`` once sympy flattens the nested ones of the same name."""
    n, stack = 0, list(call.args)
    while stack:
        arg = stack.pop()
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == name:
            stack.extend(arg.args)
        else:
            n += 1
    return n


def _python_subset(text: Any, names: frozenset[str], attrs: frozenset[str], *, keywords: bool) -> bool:
    """Whether ``text`` parses as an expression made only of arithmetic, comparisons, calls of
    ``names`` (or methods in ``attrs``), numbers below 2**64, identifier-like strings and, with
    ``keywords``, ``name=value`` arguments of booleans or integers up to 4096. No attribute escapes, no powers (an
    exponential computation), no string that could close the literal torch pastes it into."""
    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, _AST_GRAMMAR):
            continue
        if isinstance(node, ast.Name) and node.id in names:
            continue
        if isinstance(node, ast.Attribute) and node.attr in attrs:
            continue
        if isinstance(node, ast.keyword) and keywords and node.arg is not None \
                and _IDENTIFIER.fullmatch(node.arg) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, (bool, int)) and abs(node.value.value) <= 4096:
            continue
        if isinstance(node, ast.Constant) and (
                isinstance(node.value, bool) or node.value is None
                or isinstance(node.value, (int, float)) and abs(node.value) < 2**64
                or isinstance(node.value, str) and _IDENTIFIER.fullmatch(node.value)):
            continue
        return False
    return True


def _resolve_target(target: str) -> Any:
    """The object torch's deserializer binds ``target`` to (its ``deserialize_operator``)."""
    head, *names = target.split(".")
    obj: Any = {"torch": torch, "_operator": operator, "math": math}[head]
    for name in names:
        if name.startswith("_") and head != "torch" or not hasattr(obj, name):
            return target  # unresolved: torch keeps the string and refuses the node
        obj = getattr(obj, name)
    return obj


def _is_operator(obj: Any) -> bool:
    if isinstance(obj, torch._ops.OpOverload):
        return obj._schema.name not in _EFFECTS
    if isinstance(obj, torch._ops.HigherOrderOperator):
        # control flow and functionalization only: others call compiled code, delegates or
        # Python functions named in their arguments
        return obj.name() in _HOPS
    if isinstance(obj, str):
        return True  # left unresolved, torch raises "Unsupported target type" itself
    try:
        return obj in _SYM_OPS or obj is operator.getitem
    except TypeError:  # unhashable
        return False
