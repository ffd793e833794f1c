"""Reading compiled XLA programs: fused kernels and collective bytes.

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

XLA's ``cost_analysis()`` does not report communication either:
:func:`collective_ops` reads each collective (all-reduce, all-gather,
reduce-scatter, all-to-all, collective-permute) off the same text, with its
result bytes and the size of its device group; :func:`collective_bytes`
sums the result bytes per kind and :func:`ring_traffic` the bytes one device
sends under ring algorithms (:func:`ring_send_bytes`). The group size is
read from every form of ``replica_groups`` that XLA prints (explicit lists,
iota lists, transposed iota lists and the mesh-axes form, see
:func:`group_size`).
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import jax

__all__ = [
  "COLLECTIVES",
  "collective_bytes",
  "collective_ops",
  "copy_bytes",
  "fused_computations",
  "group_size",
  "hlo_text",
  "ring_send_bytes",
  "ring_traffic",
]

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


# -- collectives and their bytes ---------------------------------------------

#: Collective kinds reported by :func:`collective_bytes`.
COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 1,
  "u4": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3": 1,
  "f8e4m3fnuz": 1,
  "f8e5m2fnuz": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "token": 0,
}
_KINDS = "|".join(COLLECTIVES)
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
  rf"(?P<kind>{_KINDS})(?P<phase>-start|-done)?\((?P<rest>.*)$"
)
_OPERAND = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# replica_groups={{0,1},{2,3}}: explicit lists; {} is one group of all.
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<first>\{[0-9,\s]*\})?")
# replica_groups=[4,2]<=[8] or [4,2]<=[2,4]T(1,0): num_groups, group size
# (an iota of the devices, reshaped, transposed, then cut into groups).
_GROUPS_IOTA = re.compile(
  r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=\[[0-9,]*\]"
  r"(?:T\([0-9,]*\))?"
)
# replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, optionally with
# device_ids=(...) after the mesh: a group spans the named axes (or sub-axes
# 'axis_0':(pre_size)size) and the other axes index the groups.
_GROUPS_MESH = re.compile(
  r"replica_groups=mesh\[(?P<mesh>[^\]]*)\]"
  r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?"
  r"\s*\{(?P<axes>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?(?P<name>[^'=,\s]+)'?\s*=\s*(?P<size>\d+)")
_GROUP_AXIS = re.compile(
  r"'?(?P<name>[^':,\s]+)'?(?:\s*:\s*\((?P<pre>\d+)\)(?P<size>\d+))?"
)
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * _DTYPE_BYTES.get(dtype, 0)
  return total


_COPY = re.compile(r"=\s*(?P<shape>\S+)\s+copy\(")


def copy_bytes(compiled: Any) -> list[int]:
  """Bytes written by each ``copy`` instruction of a compiled program.

  XLA inserts a copy where a buffer is still read after an in-place write
  would overwrite it (a donated state array read by two kernels, one of them
  its writer); each costs a read and a write of the whole array per step.

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or its HLO
      text.

  Returns:
    The result size in bytes of every copy, in program order, of every
    dtype (``s8[1024,1024]`` is 1 MiB, ``f32[8,2]`` 64 bytes).
  """
  return [
    _shape_bytes(m.group("shape"))
    for line in hlo_text(compiled).splitlines()
    if (m := _COPY.search(line))
  ]


def group_size(attrs: str, default: int) -> int:
  """Devices per group of a collective, from its ``replica_groups``.

  XLA prints the groups in one of four forms:

  * explicit lists, ``replica_groups={{0,1},{2,3}}``: the size of the first
    list (all groups of a collective have one size); ``{}`` is a single
    group of all devices, ``default``;
  * iota, ``replica_groups=[2,4]<=[8]``: ``[num_groups, group_size]``;
  * transposed iota, ``replica_groups=[4,2]<=[2,4]T(1,0)``: the same two
    numbers (the transpose only permutes which devices form a group);
  * mesh axes, ``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}``
    (optionally with ``device_ids=(...)`` after the mesh): a group spans the
    named axes, so its size is the product of their sizes; a sub-axis
    ``'axis_0':(p)s`` contributes its own size ``s``.

  Args:
    attrs: the text of the instruction after its opcode (operands and
      attributes).
    default: the size of a group of all devices (``num_partitions`` times
      ``replica_count``), used without ``replica_groups`` or with ``{}``.

  Returns:
    The number of devices in each group.

  Examples:
    >>> group_size("replica_groups={{0,1,2,3},{4,5,6,7}}", 8)
    4
    >>> group_size("replica_groups=[4,2]<=[2,4]T(1,0)", 8)
    2
    >>> group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 8)
    2
  """
  m = _GROUPS_MESH.search(attrs)
  if m:
    sizes = {
      a.group("name"): int(a.group("size"))
      for a in _MESH_AXIS.finditer(m.group("mesh"))
    }
    size = 1
    for a in _GROUP_AXIS.finditer(m.group("axes")):
      if a.group("size") is not None:
        size *= int(a.group("size"))
      elif a.group("name") in sizes:
        size *= sizes[a.group("name")]
      else:
        raise ValueError(
          f"replica group axis {a.group('name')!r} is not an axis of the "
          f"mesh [{m.group('mesh')}] in {attrs!r}."
        )
    return size
  m = _GROUPS_IOTA.search(attrs)
  if m:
    return int(m.group("size"))
  m = _GROUPS_LIST.search(attrs)
  if m and m.group("first") is not None:
    members = m.group("first").strip("{}").split(",")
    return sum(1 for x in members if x.strip())
  return default


def collective_ops(compiled: Any) -> list[tuple[str, int, int]]:
  """The collectives of a compiled program: ``(kind, result bytes, group)``.

  An asynchronous pair (``all-gather-start`` / ``all-gather-done``) is one
  op: its bytes are the ``-done`` result's, its group the ``-start``'s
  ``replica_groups`` (read by :func:`group_size`). Ops inside loops or
  called computations count once (the program text is read, not executed).

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    One ``(kind, bytes, group_size)`` per collective, in program order.
  """
  text = hlo_text(compiled)
  m = _PARTITIONS.search(text)
  default_group = int(m.group(1)) if m else 1
  m = _REPLICAS.search(text)
  default_group *= int(m.group(1)) if m else 1
  starts: dict[str, str] = {}
  ops = []
  for line in text.splitlines():
    m = _INSTR.match(line)
    if m is None:
      continue
    kind, phase = m.group("kind"), m.group("phase")
    attrs = m.group("rest")
    if phase == "-start":
      starts[m.group("name")] = attrs
      continue
    if phase == "-done":
      operand = _OPERAND.search(attrs)
      attrs = starts.get(operand.group(1), "") if operand else ""
    ops.append(
      (kind, _shape_bytes(m.group("shape")), group_size(attrs, default_group))
    )
  return ops


def collective_bytes(compiled: Any) -> dict[str, int]:
  """Result bytes of each collective kind in a compiled program's HLO.

  XLA's ``cost_analysis()`` does not report communication; this reads the
  collectives off ``compiled.as_text()``: for each of ``"all-reduce"``,
  ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` and
  ``"collective-permute"``, the sum of the result sizes (bytes per device)
  of its ops, counting an asynchronous start/done pair once.

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    A dict with every kind (0 when absent).

  Examples:
    >>> hlo = "\\n".join([
    ...     "%s = (f32[10], f32[80]) all-gather-start(%x), dimensions={0}",
    ...     "%d = f32[80]{0} all-gather-done((f32[10], f32[80]) %s)",
    ...     "%r = f32[] all-reduce(%y), replica_groups={{0,1}}, to_apply=%add"])
    >>> collective_bytes(hlo)
    {'all-reduce': 4, 'all-gather': 320, 'reduce-scatter': 0, 'all-to-all': 0, 'collective-permute': 0}
  """
  totals: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
  for kind, size, _ in collective_ops(compiled):
    totals[kind] += size
  return totals


def ring_send_bytes(kind: str, size: float, group: int) -> float:
  r"""Bytes one device sends for one collective under a ring algorithm.

  For result ``size`` bytes :math:`S` over a group of ``group`` devices
  :math:`g`: all-reduce :math:`2 \frac{g-1}{g} S`; all-gather and
  all-to-all :math:`\frac{g-1}{g} S`; reduce-scatter :math:`(g-1) S`;
  collective-permute :math:`S`. This is the bandwidth term of the standard
  ring algorithms (Patarasuk and Yuan, 2009), the model behind the traffic
  law of ``docs/communication.md``.
  """
  if isinstance(size, bool) or not isinstance(size, numbers.Real):
    raise TypeError(f"`size` must be a number of bytes, got {size!r}.")
  if isinstance(group, bool) or not isinstance(group, numbers.Integral):
    raise TypeError(f"`group` must be an int (devices), got {group!r}.")
  g = max(int(group), 1)
  if kind == "all-reduce":
    return 2 * (g - 1) / g * size
  if kind in ("all-gather", "all-to-all"):
    return (g - 1) / g * size
  if kind == "reduce-scatter":
    return (g - 1) * size
  if kind == "collective-permute":
    return float(size)
  raise ValueError(f"`kind` must be one of {COLLECTIVES}, got {kind!r}.")


def ring_traffic(compiled: Any) -> dict[str, float]:
  """Bytes each device sends per collective kind, for ring algorithms.

  Sums :func:`ring_send_bytes` over the program's collectives (each with its
  own group size, from ``replica_groups``).

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    A dict with every kind of :data:`COLLECTIVES` and ``"total"``.
  """
  totals: dict[str, float] = dict.fromkeys(COLLECTIVES, 0.0)
  for kind, size, group in collective_ops(compiled):
    totals[kind] += ring_send_bytes(kind, size, group)
  totals["total"] = sum(totals[k] for k in COLLECTIVES)
  return totals
