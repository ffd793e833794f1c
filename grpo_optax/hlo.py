"""Reading compiled XLA programs: the fused kernels that decide compile time.

XLA compiles each distinct fused computation of a program on its own, so the
compile time of an optimizer step follows the number of *distinct* fused
computations in its HLO, not the number of instructions (``docs/design.md``,
"Compile cost"). Two fusions whose bodies are equal up to the names of their
instructions and parameters share one compiled kernel; a per-leaf constant (an
index into a shared vector, a leaf-specific stride) that fuses into a leaf's
kernel makes that kernel distinct, and the count then grows with the number of
leaves.

:func:`fused_computations` counts them from ``compiled.as_text()``, so a test
can assert that the count of an update does not grow with the number of leaves.
"""

from __future__ import annotations

import re
from typing import Any

import jax

__all__ = ["fused_computations", "hlo_text"]

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*)?\{\s*$")
_FUSION_CALL = re.compile(r"\bfusion\(.*\bcalls=%?(?P<name>[\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_PARAM_NAME = re.compile(r"\b(param_[\w.\-]+|Arg_[\w.\-]+)")
# Attributes that carry no semantics: debug metadata, scheduling hints and
# backend configs that name other instructions.
_NOISE = re.compile(
  r",\s*(?:metadata|frontend_attributes|backend_config|statistics|"
  r"origin|sharding)=(?:\{(?:[^{}]|\{[^{}]*\})*\}|\"[^\"]*\"|[^,\s]+)"
)


def hlo_text(compiled: Any) -> str:
  """The optimized HLO text of a ``Compiled`` or ``Lowered`` program (or text)."""
  if isinstance(compiled, str):
    return compiled
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  return compiled.as_text()


def _computations(text: str) -> dict[str, list[str]]:
  """Computation name -> its body lines (the header and ``}`` left out)."""
  comps: dict[str, list[str]] = {}
  current: list[str] | None = None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line.strip())
      if m and not line.startswith(" "):
        current = comps.setdefault(m.group("name"), [])
      continue
    if line.strip() == "}":
      current = None
      continue
    current.append(line.strip())
  return comps


def _canonical(
  name: str, comps: dict[str, list[str]], memo: dict[str, str]
) -> str:
  """A computation's body with its own names numbered by first appearance.

  A reference to another computation (a reducer's ``to_apply``, a nested
  fusion's ``calls``) is replaced by that computation's canonical body, so
  two kernels that call different reducers stay apart.
  """
  if name in memo:
    return memo[name]
  memo[name] = "<recursive>"
  numbering: dict[str, str] = {}
  out = []
  for line in comps.get(name, []):
    line = _NOISE.sub("", line)

    def rename(m: re.Match[str]) -> str:
      ref = m.group(1)
      if ref in comps and ref != name:
        return "{" + _canonical(ref, comps, memo) + "}"
      return numbering.setdefault(ref, f"%v{len(numbering)}")

    line = _NAME.sub(rename, line)
    line = _PARAM_NAME.sub(
      lambda m: numbering.setdefault(m.group(1), f"%v{len(numbering)}"), line
    )
    out.append(line)
  memo[name] = "\n".join(out)
  return memo[name]


def fused_computations(compiled: Any) -> dict[str, int]:
  """Counts the fused computations of a compiled program, and distinct ones.

  Bodies are compared after numbering their instructions and parameters in
  order of appearance and dropping metadata, so two leaves of one shape whose
  kernels compute the same thing count once, and a kernel that reads a
  different constant (say ``slice(vector, i)`` with its own ``i``) counts
  apart.

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or its HLO
      text.

  Returns:
    ``{"fusions": calls of fused computations, "distinct": distinct bodies}``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda t: jax.tree.map(lambda x: jnp.sin(x) * 2, t))
    >>> tree = [jnp.ones(8) for _ in range(6)]
    >>> fused_computations(f.lower(tree).compile())["distinct"]
    1
  """
  text = hlo_text(compiled)
  comps = _computations(text)
  called = []
  for body in comps.values():
    for line in body:
      m = _FUSION_CALL.search(line)
      if m:
        called.append(m.group("name"))
  memo: dict[str, str] = {}
  distinct = {_canonical(n, comps, memo) for n in called}
  return {"fusions": len(called), "distinct": len(distinct)}
