r"""The compressor interface of the gradient exchange, and its options.

A *compressor* turns each replica's accumulated gradient :math:`a_i` (a list
of float leaves) into a payload, moves the payloads between the replicas with
collectives, and gives every replica the same approximate mean
:math:`\frac1W \sum_i a_i` plus its own residual (what the receivers did not
get of :math:`a_i`). The five parts, each a method of :class:`Compressor`:

1. ``init(shapes)``: the compressor's own state, the same on every replica
   (PowerSGD's warm-started ``Q``, the replicated support's statistics), or
   None.
2. ``compress(accs, state, axis_name)``: a :class:`Payload`, ``wire`` (what
   travels) and ``local`` (what the sender keeps to decode and to compute its
   residual). Choosing what to send may itself use a small collective (the
   all-reduced chunk norms of the shared support).
3. ``collective(wire, local, axis_name)``: the collective(s) that move the
   payload (an all-gather of bytes, an all-reduce of a summable payload).
4. ``decompress(received, local, accs, state)``: a :class:`Decompressed`, the
   mean (the same on every replica), this replica's residual, the mask of
   the entries it sent (for momentum factor masking) and the new state.
5. ``payload_bytes(shapes, num_replicas)``: the bytes one replica puts on
   the wire per exchange (the collectives' operands).

:meth:`Compressor.mean` composes 2-4. The options a compressor takes are
declared once, as :class:`Option` values in its ``options``; the registry
(:mod:`grpo_optax.training.compressors`) gathers them for the argument checks,
the examples' flags and the documentation. Error feedback, Deep Gradient
Compression's momentum correction, masking, local clipping and sparsity
warm-up wrap any compressor (:mod:`grpo_optax.training.exchange`).

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Karimireddy, Rebjock, Stich, Jaggi. Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes. ICML 2019. https://arxiv.org/abs/1901.09847
"""

from __future__ import annotations

import abc
import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import numpy as np

AxisName = Any  # A mesh axis name, or a tuple of them.
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Option:
  """A keyword option of a compressor (or of the exchange around it).

  Attributes:
    name: the keyword.
    default: its value when not given.
    kind: ``"float"``, ``"int"``, ``"bool"``, ``"choice"`` or
      ``"optional_float"`` (None or a float).
    low: the lower end of a number's allowed range (None: unbounded).
    high: the upper end (None: unbounded).
    low_open: whether the range excludes ``low``.
    high_open: whether the range excludes ``high``.
    choices: the allowed values of a ``"choice"``.
    help: one line for the documentation and the examples' flags.
  """

  name: str
  default: Any
  kind: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[Any, ...] = ()
  help: str = ""

  def restrict(self, choices: tuple[Any, ...]) -> Option:
    """The same option allowing only ``choices`` (a compressor's subset)."""
    return dataclasses.replace(self, choices=tuple(choices))

  def allowed(self) -> str:
    """The allowed values without the kind: ``in (0, 1]``, ``>= 1``, ..."""
    if self.kind == "choice":
      return f"one of {self.choices}"
    if self.kind == "bool":
      return "true or false"
    if self.kind == "optional_float":
      return f"None or {self._range()}"
    return self._range()

  def _range(self) -> str:
    if self.kind == "int":
      return f">= {int(self.low or 0)}"
    if self.low is not None and self.high is None:
      return f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
    lo = ("(" if self.low_open else "[") + f"{self.low:g}"
    hi = f"{self.high:g}" + (")" if self.high_open else "]")
    return f"in {lo}, {hi}"

  def describe(self) -> str:
    """The allowed values, as the error messages and the docs write them."""
    if self.kind == "choice":
      return f"one of {self.choices}"
    if self.kind == "bool":
      return "a bool (True or False)"
    if self.kind == "optional_float":
      return f"None or a float {self._range()}"
    return f"{'an int' if self.kind == 'int' else 'a float'} {self._range()}"

  def check(self, value: Any) -> Any:
    """``value`` validated (and converted to its kind).

    Raises:
      TypeError: a value of the wrong type (a string, None or a bool for a
        float, a string or None for an int, anything but a bool for a
        flag), naming the option, what it allows and the value given.
      ValueError: a value outside the range or the choices, a
        non-integral number or a bool for an int, likewise named.
    """
    message = f"`{self.name}` must be {self.describe()}, got {value!r}."
    if self.kind == "choice":
      if not _is_hashable(value) or value not in self.choices:
        raise ValueError(message)
      return value
    if self.kind == "bool":
      if not isinstance(value, bool):
        raise TypeError(message)
      return value
    if self.kind == "optional_float" and value is None:
      return None
    if self.kind == "int" and isinstance(value, (bool, np.bool_)):
      raise ValueError(message)  # As training's other int checks.
    if not _is_real(value):
      raise TypeError(message)
    try:
      v = operator.index(value) if self.kind == "int" else float(value)
    except TypeError:
      raise ValueError(message) from None
    if math.isnan(v):
      raise ValueError(message)
    if self.low is not None and (
      v <= self.low if self.low_open else v < self.low
    ):
      raise ValueError(message)
    if self.high is not None and (
      v >= self.high if self.high_open else v > self.high
    ):
      raise ValueError(message)
    return v


def _is_hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def _is_real(value: Any) -> bool:
  """A real number: a Python or NumPy int or float, or a 0-d array of one;
  not a bool, a string, None or a sequence.
  """
  if isinstance(value, (bool, np.bool_)):
    return False
  if isinstance(value, (int, float, np.integer, np.floating)):
    return True
  return (
    hasattr(value, "dtype")
    and np.ndim(value) == 0
    and np.issubdtype(value.dtype, np.number)
  )


# The options shared by several compressors (each compressor lists the ones
# it takes, possibly with fewer choices).

#: The kept fraction of a sparse compressor, in (0, 1] (default 0.3).
FRACTION = Option(
  "fraction",
  0.3,
  "float",
  low=0.0,
  high=1.0,
  low_open=True,
  help="kept fraction of the entries (per leaf, or of the chunks of the "
  "model), after the sparsity warm-up",
)
#: Entries per chunk of a chunked compressor, an int >= 1 (default 64).
CHUNK_SIZE = Option(
  "chunk_size",
  64,
  "int",
  low=1,
  help="entries per chunk (a leaf's last chunk, or a smaller leaf, is "
  "zero-padded)",
)
#: The payload's value format: float32, bfloat16 or int8 (default float32).
VALUES = Option(
  "values",
  "float32",
  "choice",
  choices=("float32", "bfloat16", "int8"),
  help="payload values: float32 (4 bytes), bfloat16 (2) or int8 (1, with a "
  "4-byte scale per leaf and replica)",
)


class Payload(NamedTuple):
  """What :meth:`Compressor.compress` makes of one replica's values.

  Attributes:
    wire: what the collective moves.
    local: what the sender keeps (to decode its own contribution, compute
      its residual, or run a second round).
  """

  wire: Any
  local: Any


class Decompressed(NamedTuple):
  """The result of one exchange, on one replica.

  Attributes:
    means: per leaf, the mean over the replicas of what they sent (the same
      on every replica), in the leaf's dtype.
    residuals: per leaf, this replica's value minus what the receivers
      decode of it (error feedback keeps it).
    sent: per leaf, a boolean mask of the entries this replica sent, or
      None where the compressor sends no entries as such (PowerSGD): the
      momentum factor masking of Deep Gradient Compression reads it.
    state: the compressor's new state (the same on every replica).
  """

  means: list[Any]
  residuals: list[Any]
  sent: list[Any] | None
  state: Any


class Compressor(abc.ABC):
  """A compressed (or dense) mean over the replicas; see the module docstring.

  Subclasses set ``name`` (the registry key, the
  ``exchange=`` value), :attr:`Compressor.options` (the keyword options
  they take) and implement the five parts. An instance holds validated option values as attributes
  (``self.fraction``, ...); it is immutable and hashable, so a compiled
  program can close over it.
  """

  #: The registry key (``exchange="..."``).
  name: ClassVar[str]
  #: The keyword options this compressor takes.
  options: ClassVar[tuple[Option, ...]] = ()
  #: Why this compressor does not take (or restricts) an option, by option
  #: name; the reason is added to the error message.
  notes: ClassVar[dict[str, str]] = {}
  #: Whether the mean is exact and leaves nothing behind (no residual is
  #: kept: error feedback has nothing to feed back).
  lossless: ClassVar[bool] = False
  #: The validated option values, ``((name, value), ...)``.
  _values: tuple[tuple[str, Any], ...]

  def __init__(self, **options: Any):
    mine = {o.name: o for o in self.options}
    unknown = sorted(set(options) - set(mine))
    if unknown:
      raise TypeError(
        f"the {self.name!r} compressor takes the options {tuple(mine)}, got "
        f"{unknown}."
      )
    values = tuple(
      (n, o.check(options.get(n, o.default))) for n, o in mine.items()
    )
    object.__setattr__(self, "_values", values)
    for n, v in values:
      object.__setattr__(self, n, v)

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"{type(self).__name__} is immutable.")

  def __eq__(self, other: object) -> bool:
    return (
      type(other) is type(self) and other._values == self._values  # type: ignore[attr-defined]
    )

  def __hash__(self) -> int:
    return hash((type(self), self._values))

  def __repr__(self) -> str:
    args = ", ".join(f"{n}={v!r}" for n, v in self._values)
    return f"{type(self).__name__}({args})"

  @property
  def stateful(self) -> bool:
    """Whether :meth:`Compressor.init` makes a state (carried from step to
    step).
    """
    return self.init([]) is not None

  @property
  def sparse(self) -> bool:
    """Whether it sends a ``fraction`` of the entries (the warm-up applies)."""
    return any(o.name == "fraction" for o in self.options)

  @property
  def config(self) -> dict[str, Any]:
    """The option values, by name."""
    return dict(self._values)

  def replace(self, **changes: Any) -> Compressor:
    """A copy with some options changed (e.g. a warm-up stage's fraction)."""
    return type(self)(**{**self.config, **changes})

  def check_replicas(self, num_replicas: int) -> None:
    """Raises ``ValueError`` if the compressor cannot serve ``num_replicas``
    replicas (checked when a step is built).
    """
    del num_replicas

  # -- the five parts ---------------------------------------------------------

  def init(self, shapes: Sequence[Shape], seed: int = 0) -> Any:
    """The compressor's state for leaves of ``shapes`` (None: stateless);
    ``seed`` draws any random initial value (the same on every replica).
    """
    del shapes, seed
    return None

  @abc.abstractmethod
  def compress(
    self, accs: Sequence[Any], state: Any, axis_name: AxisName
  ) -> Payload:
    """The payload of this replica's ``accs`` (a list of float leaves)."""

  @abc.abstractmethod
  def collective(self, wire: Any, local: Any, axis_name: AxisName) -> Any:
    """Moves the payloads over ``axis_name``; returns what arrived."""

  @abc.abstractmethod
  def decompress(
    self, received: Any, local: Any, accs: Sequence[Any], state: Any
  ) -> Decompressed:
    """The mean, this replica's residual, its sent mask and the new state."""

  @abc.abstractmethod
  def payload_bytes(self, shapes: Sequence[Shape], num_replicas: int) -> int:
    """Bytes one replica sends per exchange (the collectives' operands)."""

  def mean(
    self, accs: Sequence[Any], state: Any, axis_name: AxisName
  ) -> Decompressed:
    """compress, collective, decompress."""
    payload = self.compress(accs, state, axis_name)
    received = self.collective(payload.wire, payload.local, axis_name)
    return self.decompress(received, payload.local, accs, state)


__all__ = (
  "CHUNK_SIZE",
  "FRACTION",
  "VALUES",
  "Compressor",
  "Decompressed",
  "Option",
  "Payload",
)
