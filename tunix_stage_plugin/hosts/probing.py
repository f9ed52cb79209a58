"""Capability probes shared by the host adapters: does a host have what the hooks rely on, with
the expected shape? Probing never changes the host. An adapter's probes are a table (`run`): one
row per probe, its checks in order, each with the refusal line where it does not hold.

What a hook relies on in a body is read from the method's parsed code (`Body`), never from its
text, so a comment or a string cannot satisfy a probe; where a hook reproduces a host method's
body, `fingerprint` pins the body it was written against (docs/tunix.md "The train loop, two ways").
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import textwrap
from typing import Any, Callable, Iterable, Sequence

from tunix_stage_plugin.core import patching


@dataclasses.dataclass(frozen=True)
class Probe:
  """One capability the hooks rely on, checked before anything is patched."""

  name: str
  ok: bool
  detail: str = ""


def parameters(fn: Any) -> dict[str, inspect.Parameter]:
  return dict(inspect.signature(fn).parameters)


def has_var_kwargs(fn: Any) -> bool:
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters(fn).values())


# One thing a probe checks on the probed host (`subject`: its module, or the classes the hooks
# patch): None when it holds, else the refusal line.
Check = Callable[[Any], "str | None"]


def run(table: Iterable[tuple[str, Sequence[Check]]], subject: Any) -> list[Probe]:
  """A host's probe table, one row per probe (its name, its checks in order), run on `subject`:
  a probe's refusal line is its first check's that does not hold."""
  return [_probe(name, checks, subject) for name, checks in table]


def _probe(name: str, checks: Sequence[Check], subject: Any) -> Probe:
  try:
    problem = next((p for p in (check(subject) for check in checks) if p is not None), None)
  except Exception as e:  # pylint: disable=broad-except  (a probe that cannot run has failed)
    problem = f"{type(e).__name__}: {e}"
  return Probe(name, problem is None, problem or "ok")


def that(holds: Callable[[Any], bool], refusal: str) -> Check:
  """A check: `refusal` unless `holds(subject)`."""
  return lambda subject: None if holds(subject) else refusal


def has_all(what: str, found: Callable[[Any], Iterable[str]], needed: Sequence[str]) -> Check:
  """A check: `found(subject)` holds each of `needed`; else "<what> lacks [those missing]"."""

  def missing(subject: Any) -> str | None:
    have = set(found(subject))
    lacking = [n for n in needed if n not in have]
    return f"{what} lacks {lacking}" if lacking else None

  return missing


def has_method(on: str, attr: str, *, params: tuple[str, ...], coroutine: bool,
               var_kwargs: bool = False, own: bool = False) -> Check:
  """A check: the subject's `on` (a class) has the method `attr` of that shape (its own, with
  `own`)."""

  def shape(subject: Any) -> str | None:
    cls = getattr(subject, on)
    # getattr_static: no descriptor runs, so probing leaves the class untouched (a plain getattr
    # of e.g. __annotations__ would create and store one on Python 3.12).
    fn = cls.__dict__.get(attr) if own else inspect.getattr_static(cls, attr, None)
    if fn is None:
      return f"{cls.__qualname__}.{attr} is missing"
    if inspect.iscoroutinefunction(fn) != coroutine:
      return f"{cls.__qualname__}.{attr} is {'not ' if coroutine else ''}a coroutine function"
    missing = [p for p in params if p not in parameters(fn)]
    if missing:
      return f"{cls.__qualname__}.{attr}{inspect.signature(fn)} lacks {missing}"
    if var_kwargs and not has_var_kwargs(fn):
      return f"{cls.__qualname__}.{attr}{inspect.signature(fn)} takes no **kwargs"
    return None

  return shape


def is_free(on: str, *attrs: str) -> Check:
  """A check: the subject's `on` (a class) has none of `attrs` (the names the hooks add) nor the
  plugin's mark."""

  def free(subject: Any) -> str | None:
    cls = getattr(subject, on)
    taken = [a for a in attrs + (patching.SENTINEL,) if hasattr(cls, a)]
    if taken:
      return (f"{cls.__qualname__} already has {taken} (the host's own, or another copy of the "
              "plugin installed)")
    return None

  return free


class Body:
  """A function's parsed code: the calls it makes and the attributes it assigns, by dotted name
  ("self._prepare_payload", "engine.train_step"), in the order they appear.

  Raises OSError where the source is not available (a host installed without its .py files).
  """

  def __init__(self, fn: Any) -> None:
    (self.node,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body

  def calls(self, name: str) -> list[ast.Call]:
    """Every call of `name` (a dotted name), in source order."""
    return [n for n in ast.walk(self.node)
            if isinstance(n, ast.Call) and dotted(n.func) == name]

  def call_order(self, *names: str) -> list[str]:
    """Which of `names` are called, each at its first call, in the order of those first calls."""
    first: dict[str, tuple[int, int]] = {}
    for name in names:
      found = self.calls(name)
      if found:
        first[name] = min((c.lineno, c.col_offset) for c in found)
    return sorted(first, key=first.__getitem__)

  def assigns(self, name: str) -> bool:
    """Whether the body assigns the dotted name `name` (`self._server = ...`)."""
    for n in ast.walk(self.node):
      targets = (n.targets if isinstance(n, ast.Assign) else
                 [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else [])
      if any(dotted(t) == name for t in targets):
        return True
    return False

  def iterates(self, name: str, *, is_async: bool) -> list[ast.For | ast.AsyncFor]:
    """The (async) for loops over the dotted name `name`."""
    kind = ast.AsyncFor if is_async else ast.For
    return [n for n in ast.walk(self.node) if isinstance(n, kind) and dotted(n.iter) == name]

  def string_arguments(self, name: str) -> set[str]:
    """The string constants passed, positionally or by keyword, to calls ending in `.name` or
    named `name` (`parser.add_argument("--flag")` for "add_argument")."""
    found = set()
    for n in ast.walk(self.node):
      if isinstance(n, ast.Call) and (dotted(n.func) or "").split(".")[-1] == name:
        for arg in [*n.args, *(k.value for k in n.keywords)]:
          if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(arg.value)
    return found


def dotted(node: Any) -> str | None:
  """`a.b.c` for a Name/Attribute chain; None for anything else (a call's result, a subscript)."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return ".".join([node.id, *reversed(parts)])


def keywords(call: ast.Call) -> set[str]:
  return {k.arg for k in call.keywords if k.arg is not None}


FINGERPRINT_HEX_DIGITS = 16


def fingerprint(fn: Any) -> str:
  """`fn`'s code as 16 hex digits: a hash of its syntax tree, docstring left out.

  Formatting, comments and the docstring leave it unchanged, and it is the same on Python 3.11
  to 3.13; a changed statement, expression, name, argument or decorator changes it. Raises
  OSError where `fn`'s source is not available (a host installed without its .py files).
  """
  return source_fingerprint(textwrap.dedent(inspect.getsource(fn)))


def source_fingerprint(source: str) -> str:
  """`fingerprint` of the one function definition `source` holds."""
  (node,) = ast.parse(source).body
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    raise ValueError(f"expected one function definition; got {type(node).__name__}")
  body = node.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
      and isinstance(body[0].value.value, str):
    body = body[1:]  # the docstring
  tree = _shape(node, body=body)
  return hashlib.sha256(repr(tree).encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def _shape(node: Any, **replaced: Any) -> Any:
  """A node as (type name, its non-empty fields): what `ast.dump` shows, minus positions and
  the fields a Python version adds empty (3.12's `type_params`) or leaves None (`kind`)."""
  if isinstance(node, list):
    return [_shape(n) for n in node]
  if not isinstance(node, ast.AST):
    return repr(node)  # a constant's value, an identifier, an operator's name
  fields = {**dict(ast.iter_fields(node)), **replaced}
  return (type(node).__name__, tuple((name, _shape(value)) for name, value in fields.items()
                                     if value is not None and value != []))
