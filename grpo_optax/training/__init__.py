"""Mechanisms that change the training program, not just the gradients.

A ``GradientTransformation`` only sees finished gradients, after their compute
and memory are spent. The steps here change the program itself:

* :func:`hierarchical_step`: exact gradients for core parameters every step,
  non-core gradients only every ``refresh_every`` steps (the skip step does
  not differentiate them at all).
* :func:`train_step` (donated, in-place) and :func:`layerwise_train_step`
  (fused backward + update per layer of a scanned stack, LOMO-style).
* :func:`frozen_train_step`: frozen leaves are never differentiated.
* :func:`data_parallel` (:class:`DataParallel`): the data-parallel runtime,
  one train step over a mesh that carries the model's mutable state
  (BatchNorm statistics), auxiliary outputs, a PRNG key per replica, the
  exchange of any compressor (:mod:`grpo_optax.training.compressors`, one
  registry; :func:`make_exchange`, :func:`sparse_pmean`) and local steps
  (DiLoCo) as a mode; checkpoints with
  :mod:`grpo_optax.training.checkpointing`. :func:`data_parallel_step` and
  :func:`local_steps_step`
  are its forms for a plain ``loss_fn(params, batch)``;
  :func:`collective_bytes` and :func:`ring_traffic` (from
  :mod:`grpo_optax.hlo`) read the traffic off the program.

The others take plain pytrees and a ``loss_fn(params, batch)``;
:func:`split_model` turns a Flax NNX model into that form, and
:func:`split_model_with_state` into the runtime's (Flax is imported only
there).
"""

from grpo_optax.hlo import COLLECTIVES
from grpo_optax.hlo import collective_bytes
from grpo_optax.hlo import collective_ops
from grpo_optax.hlo import ring_send_bytes
from grpo_optax.hlo import ring_traffic
from grpo_optax.training import checkpointing
from grpo_optax.training import compression
from grpo_optax.training import compressors
from grpo_optax.training import exchange
from grpo_optax.training._nnx import PureModel
from grpo_optax.training._nnx import StatefulModel
from grpo_optax.training._nnx import split_model
from grpo_optax.training._nnx import split_model_with_state
from grpo_optax.training.distributed import DataParallelState
from grpo_optax.training.distributed import DataParallelStep
from grpo_optax.training.distributed import data_parallel_step
from grpo_optax.training.exchange import EXCHANGES
from grpo_optax.training.exchange import Exchange
from grpo_optax.training.exchange import ExchangeState
from grpo_optax.training.exchange import init_exchange
from grpo_optax.training.exchange import make_exchange
from grpo_optax.training.exchange import sparse_pmean
from grpo_optax.training.freezing import FrozenStep
from grpo_optax.training.freezing import frozen_train_step
from grpo_optax.training.hierarchical import DEFAULT_NONCORE_PATTERN
from grpo_optax.training.hierarchical import HierarchicalState
from grpo_optax.training.hierarchical import HierarchicalStep
from grpo_optax.training.hierarchical import default_is_core
from grpo_optax.training.hierarchical import hierarchical_step
from grpo_optax.training.immediate import LayerwiseState
from grpo_optax.training.immediate import LayerwiseStep
from grpo_optax.training.immediate import StackedParams
from grpo_optax.training.immediate import layerwise_train_step
from grpo_optax.training.immediate import stacked_loss_fn
from grpo_optax.training.immediate import train_step
from grpo_optax.training.local_steps import INT8_OUTER
from grpo_optax.training.local_steps import QUANTIZE
from grpo_optax.training.local_steps import LocalSteps
from grpo_optax.training.local_steps import LocalStepsState
from grpo_optax.training.local_steps import default_outer_optimizer
from grpo_optax.training.local_steps import exchange_mean
from grpo_optax.training.local_steps import int8_levels
from grpo_optax.training.local_steps import local_steps_step
from grpo_optax.training.local_steps import outer_step
from grpo_optax.training.local_steps import round_traffic_per_step
from grpo_optax.training.outer import OuterResult
from grpo_optax.training.outer import OuterState
from grpo_optax.training.outer import outer_exchange
from grpo_optax.training.runtime import DataParallel
from grpo_optax.training.runtime import StepOutput
from grpo_optax.training.runtime import TrainState
from grpo_optax.training.runtime import data_parallel

__all__ = (
  "COLLECTIVES",
  "DEFAULT_NONCORE_PATTERN",
  "DataParallel",
  "DataParallelState",
  "DataParallelStep",
  "EXCHANGES",
  "Exchange",
  "ExchangeState",
  "FrozenStep",
  "HierarchicalState",
  "HierarchicalStep",
  "INT8_OUTER",
  "LayerwiseState",
  "LayerwiseStep",
  "LocalSteps",
  "LocalStepsState",
  "OuterResult",
  "OuterState",
  "PureModel",
  "QUANTIZE",
  "StackedParams",
  "StatefulModel",
  "StepOutput",
  "TrainState",
  "checkpointing",
  "collective_bytes",
  "collective_ops",
  "compression",
  "compressors",
  "data_parallel",
  "data_parallel_step",
  "default_is_core",
  "default_outer_optimizer",
  "exchange",
  "exchange_mean",
  "frozen_train_step",
  "hierarchical_step",
  "init_exchange",
  "int8_levels",
  "layerwise_train_step",
  "local_steps_step",
  "make_exchange",
  "outer_exchange",
  "outer_step",
  "ring_send_bytes",
  "ring_traffic",
  "round_traffic_per_step",
  "sparse_pmean",
  "split_model",
  "split_model_with_state",
  "stacked_loss_fn",
  "train_step",
)
