"""``code_fingerprint="auto"``: a fingerprint of a flow body's syntax tree.

The rule (decision 0010):

* **Hashed:** the flow function's syntax tree as written: its name, its
  parameters and annotations, and every statement and expression of its body,
  including the functions, lambdas and classes defined inside it (they are part
  of the body's text). String and number literals are hashed exactly.
* **Not hashed:** comments and formatting (the tree has none: they are dropped
  by construction), docstrings (of the flow function and of everything defined
  in it), and the decorator list (``@flow(...)``'s arguments are the structure
  the flow hash already covers, and ``compatible_with`` is a reviewer's
  assertion about the code, not code). Nothing else is normalised: renaming a
  local variable changes the fingerprint.
* **Out of reach:** code the body calls but does not contain (a module-level
  helper, an imported function, a wrapper decorator) and the values of
  variables it closes over. When such code decides which steps the body asks
  for, pass an explicit fingerprint your toolchain computes.

``Function.__code__`` (bytecode, constants, line table) is deliberately not
used: CPython changes its bytecode in every minor version, so a fleet upgrading
Python would see every in-flight execution as changed code. The tree is
serialised by this module (node names, fields that hold something, literal
reprs), not by ``ast.dump``, whose output format itself changed in 3.13.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from fleet.kernel.errors import ConfigurationError

AUTO = "auto"
AUTO_PREFIX = "auto:"

# Fields that record how something was written, not what it does: the ``u``
# prefix of a string literal and a ``# type:`` comment.
_SKIPPED_FIELDS = frozenset({"kind", "type_comment"})
_DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def auto_fingerprint(body: Callable[..., Any], flow_id: str) -> str:
    """``auto:`` + SHA-256 of ``body``'s normalised syntax tree (see the module docstring).

    Raises:
        ConfigurationError: the source of ``body`` cannot be read (defined in a
            REPL or by ``exec``), so there is nothing to fingerprint.
    """
    name = getattr(body, "__name__", repr(body))
    try:
        source = inspect.getsource(body)
    except (OSError, TypeError) as exc:
        raise ConfigurationError(
            f"flow {flow_id!r}: code_fingerprint='auto' needs the source of {name!r} and "
            f"Python cannot read it ({exc}); this happens for code typed into a REPL or "
            "built with exec(). Pass an explicit fingerprint, code_fingerprint='<your hash>'"
        ) from None
    node = _function_node(source, name, flow_id)
    out: list[str] = []
    _serialise(_without_docstrings(node), out)
    return AUTO_PREFIX + hashlib.sha256("".join(out).encode()).hexdigest()


def _function_node(source: str, name: str, flow_id: str) -> ast.AST:
    # A def nested in a function or class comes back indented. Parsing it under
    # ``if 1:`` keeps every line, string literals included, byte for byte
    # (textwrap.dedent would rewrite a multi-line literal's indentation).
    if source[:1] in (" ", "\t"):
        wrapper = ast.parse("if 1:\n" + source).body[0]
        assert isinstance(wrapper, ast.If)
        statements = wrapper.body
    else:
        statements = ast.parse(source).body
    for statement in statements:
        if isinstance(statement, ast.AsyncFunctionDef | ast.FunctionDef) \
                and statement.name == name:
            return statement
    raise ConfigurationError(
        f"flow {flow_id!r}: code_fingerprint='auto' found no definition of {name!r} in its "
        "source; pass an explicit fingerprint")


def _without_docstrings(node: ast.AST) -> ast.AST:
    """A copy of the function without its decorators and without the docstring
    of every function and class in it (its own included)."""
    node = copy.deepcopy(node)
    for child in ast.walk(node):
        if isinstance(child, _DOCUMENTED) and child.body:
            first = child.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                child.body = child.body[1:]
    if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
        node.decorator_list = []
    return node


def _serialise(value: Any, out: list[str]) -> None:
    """An unambiguous text of a tree: ``Name(field=...,...)``; empty fields omitted.

    Omitting fields that hold ``None`` or ``[]`` keeps the text of code that
    uses no new syntax the same when a Python version adds a field (3.12's
    ``type_params``).
    """
    if isinstance(value, ast.AST):
        out.append(type(value).__name__)
        out.append("(")
        for field in value._fields:
            if field in _SKIPPED_FIELDS:
                continue
            item = getattr(value, field, None)
            literal = isinstance(value, ast.Constant) and field == "value"
            if not literal and (item is None or (isinstance(item, list) and not item)):
                continue
            out.append(field)
            out.append("=")
            _serialise(item, out)
            out.append(",")
        out.append(")")
    elif isinstance(value, list):
        out.append("[")
        for item in value:
            _serialise(item, out)
            out.append(",")
        out.append("]")
    else:
        # A literal or an identifier: its type and repr, so 1, 1.0, True and
        # "1" all differ and a quote inside a string cannot end it early.
        out.append(f"{type(value).__name__}:{value!r}")
