"""The shape every mechanism of the library takes: a validated config.

A mechanism is one module (``clipping``, ``sparsify``, ``momentum``, ...)
that owns its public knobs as a frozen dataclass (a subclass of
:class:`Config`, validated once in ``__post_init__``, with the errors the
user sees), its state (a ``NamedTuple``) and its ``init`` / ``update``,
methods of the config. The optax factory (``clip_with_l2(...)``) is a thin
adapter, ``Config(...).transform()``; :func:`grpo_optax.grpo` builds the
same configs from its keywords (``presets.WIRING``) and its fused core reads
them (``docs/design.md``, "Adding a mechanism").
"""

from __future__ import annotations

from typing import Any

import optax


class Config:
  """Base of the mechanisms' configs (frozen dataclasses).

  Subclasses define ``init(params)`` and ``update(updates, state,
  params=None, **extra_args)`` (optax's signatures) and validate their
  fields in ``__post_init__``; fields may hold traced values (as
  ``optax.inject_hyperparams`` passes them), which are type-checked but not
  range-checked.
  """

  def init(self, params: Any) -> Any:
    raise NotImplementedError

  def update(
    self, updates: Any, state: Any, params: Any = None, **extra_args: Any
  ) -> tuple[Any, Any]:
    raise NotImplementedError

  def transform(self) -> optax.GradientTransformationExtraArgs:
    """This mechanism as an optax transform (``init``, ``update``)."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)

  def _set(self, **values: Any) -> None:
    """Replaces fields after validation (casts) in a frozen dataclass."""
    for name, value in values.items():
      object.__setattr__(self, name, value)
