"""Python tests of a traced tensor whose other branch raises (NOTE: [Checks that raise]).

NOTE: [Checks that raise]
A forward may check its inputs with a test on their values: wav2vec2's CTC head runs `if labels.max()
>= self.config.vocab_size: raise ValueError(...)`, research code `assert torch.isfinite(x).all()`. A
trace has no values to decide the `if`, so such models could not be traced. But one branch of such a
test only raises: a call that computes anything takes the other. So where `bool()` of a traced tensor
fails, the statement it decides is read from the source (the tested expression's position in the line,
as Python 3.11 records it): an `if` whose body ends in `raise` (nothing before it but calls, no `else`),
or an `assert`, with the tensor the whole test or inside `and`/`or`/`not` of it where its answer alone
decides (the last of an `and` that must be false, say). Then the trace takes the
branch that does not raise and the program checks the tensor at every call (`aten._assert_async`, a
side effect no pass removes): a call whose values would raise in eager raises there too (on a GPU as a
device-side assert), naming the line; the read of the value the failed attempt recorded is erased (a
later run of the graph, under functionalization, would fail on it). Any other test of a value still
fails the trace, named.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import types
from typing import Any

from fbmt.logs import _LIBRARY_DIRS

_parsed: dict[str, tuple[int, ast.Module, dict[ast.AST, ast.AST]]] = {}  # file -> (lines, tree, parents)


def _user_frame() -> types.FrameType | None:
    """The innermost frame outside torch and fbmt: the model's line that asked for a tensor's truth."""
    f = sys._getframe(2)
    # by absolute path: a script that puts `tests/gpu/../..` on sys.path imports fbmt from a path with `..`
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_LIBRARY_DIRS):
        f = f.f_back
    return f


def _tree(filename: str) -> tuple[ast.Module, dict[ast.AST, ast.AST]] | None:
    lines = linecache.getlines(filename)
    if not lines:
        return None
    held = _parsed.get(filename)
    if held is None or held[0] != len(lines):
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            return None
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        held = _parsed[filename] = (len(lines), tree, parents)
    return held[1], held[2]


def _raises(statement: ast.AST) -> bool:
    """An `if` whose body only raises (after calls, such as a warning), with no `else`."""
    if not isinstance(statement, ast.If) or statement.orelse or not isinstance(statement.body[-1], ast.Raise):
        return False
    return all(isinstance(s, ast.Expr) for s in statement.body[:-1])


def _asked() -> tuple[ast.AST, list[tuple[ast.AST, ast.AST]], str] | None:
    """Where `bool()` of a traced tensor is asked: the `if` or `assert` statement whose test asks it, the
    path from its test to the tensor's expression ((expression, the operand asked), outermost first), and
    the file; None where it is asked elsewhere or cannot be read."""
    frame = _user_frame()
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    found = _tree(filename)
    # the expression tested is the one computed by the instruction before the jump that asks for its truth
    # (the jump's own position is not it: Python 3.11 gives a chain's later jumps the first operand's)
    positions = list(frame.f_code.co_positions())
    at = frame.f_lasti // 2 - 1
    if found is None or not 0 <= at < len(positions) or None in positions[at]:
        return None
    tree, parents = found
    line, end_line, col, end_col = positions[at]
    node = next(
        (
            n
            for n in ast.walk(tree)
            if (getattr(n, "lineno", None), getattr(n, "end_lineno", None)) == (line, end_line)
            and (getattr(n, "col_offset", None), getattr(n, "end_col_offset", None)) == (col, end_col)
        ),
        None,
    )
    if node is None:
        return None
    path = []  # (expression, the one of its operands the answer is asked of), the test's outermost first
    if isinstance(node, (ast.If, ast.Assert)):  # the jump is the statement's own: its test, less its `not`s
        statement, asked = node, node.test
        while isinstance(asked, ast.UnaryOp) and isinstance(asked.op, ast.Not):
            path.append((asked, asked.operand))
            asked = asked.operand
        if isinstance(asked, ast.BoolOp):  # which operand asked is not known from here
            return None
    else:
        statement = node
        while not isinstance(statement, (ast.If, ast.Assert)):
            parent = parents.get(statement)
            negation = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
            if not (negation or isinstance(parent, ast.BoolOp) or isinstance(parent, (ast.If, ast.Assert))):
                return None
            if isinstance(parent, (ast.If, ast.Assert)) and statement is not parent.test:
                return None
            if not isinstance(parent, (ast.If, ast.Assert)):
                path.insert(0, (parent, statement))
            statement = parent
    return statement, path, filename


def passing_answer() -> tuple[bool, str] | None:
    """Where the caller's caller is `bool()` of a traced tensor: the answer that does not raise, and the
    statement's `file:line: source` (the file's name); None where the test is not such a check."""
    asked = _asked()
    if asked is None:
        return None
    statement, path, filename = asked
    if isinstance(statement, ast.Assert):
        needed = True
    elif _raises(statement):
        needed = False
    else:
        return None
    for expression, operand in path:  # what each part must be for the statement not to raise
        if isinstance(expression, ast.UnaryOp):
            needed = not needed
        elif isinstance(expression.op, ast.And) != needed and operand is not expression.values[-1]:
            # `a and b` false, or `a or b` true, asks one operand only where it is the last: before it,
            # the answer that does not raise may be either
            return None
    source = linecache.getline(filename, statement.lineno).strip()
    return needed, f"{os.path.basename(filename)}:{statement.lineno}: {source}"


def check(tensor: Any, passing: bool, where: str) -> None:
    """Record in the program being traced: `bool(tensor)` is `passing` at every call, or the call raises."""
    import torch

    value = tensor != 0 if tensor.dtype != torch.bool else tensor
    said = f"fbmt: this call's values take the branch that raises in eager at {where}"
    # CUDA's kernel takes a message of under 255 characters
    torch._assert_async(value if passing else value.logical_not(), said if len(said) < 255 else said[:251] + "...")


# NOTE: [Guards of masked writes]
# `if mask.any(): x[mask] = value` (wav2vec2's pretraining loss sets to -inf the logits of sampled
# negatives equal to their positive) asks a value no trace has, but the answer changes nothing: where
# the mask has no true element, the assignments in the body write nothing. So where `bool()` of a
# traced tensor fails in the test of an `if` that is exactly `name.any()` (or `torch.any(name)`), with
# no `else`, and whose body only assigns to subscripts by that same name, the trace takes the body.
def either_answer() -> bool | None:
    """Where the caller's caller is `bool()` of a traced tensor in such an `if`: True (the body); None
    where the answer matters."""
    asked = _asked()
    if asked is None:
        return None
    statement, path, _ = asked
    if path or not isinstance(statement, ast.If) or statement.orelse:
        return None
    test = statement.test
    if not (isinstance(test, ast.Call) and not test.keywords):
        return None
    if isinstance(test.func, ast.Attribute) and test.func.attr == "any" and not test.args:
        tested = test.func.value  # name.any()
    elif _is_torch_any(test.func) and len(test.args) == 1:
        tested = test.args[0]  # torch.any(name)
    else:
        return None
    if not isinstance(tested, ast.Name):
        return None
    for s in statement.body:
        if not isinstance(s, ast.Assign) or not all(_writes_where(t, tested.id) for t in s.targets):
            return None
        if any(isinstance(n, ast.NamedExpr) for n in ast.walk(s.value)):
            return None
    return True


def _is_torch_any(func: ast.AST) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "any"
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    )


def _writes_where(target: ast.AST, name: str) -> bool:
    """`target` is `x[name]` (x any expression), an assignment where the mask `name` is true."""
    return isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Name) and target.slice.id == name
