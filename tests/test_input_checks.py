"""Input checks of the public factories, the updates' tree, and update dtypes.

* A wrong type (a string, None where it is not allowed, a bool for a number,
  an unknown dtype) is refused at construction, with a message naming the
  argument and the value (not later inside ``update``).
* Numbers still come as Python ints and floats, NumPy scalars, and concrete
  or traced JAX arrays (``optax.inject_hyperparams``); ``learning_rate`` as
  an optax schedule.
* Updates whose tree or leaf shapes differ from what the state was built
  for are refused with the leaf's path.
* Updates have the dtype optax's stateful transforms give (the gradient's
  promoted with the params-shaped state's): ``optax.adam`` on bfloat16
  gradients of float32 params gives float32 updates.
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax as go

FACTORIES = {
  "grpo": go.grpo,
  "scale_by_variance_lr": go.scale_by_variance_lr,
  "scale_by_importance": go.scale_by_importance,
  "top_k_mask": go.top_k_mask,
  "ema_threshold_mask": go.ema_threshold_mask,
  "scale_by_nesterov_adam_rms": go.scale_by_nesterov_adam_rms,
  "clip_with_l2": go.clip_with_l2,
  "freeze_below": go.freeze_below,
  "zclip": go.zclip,
}

# (factory, keyword, bad value, error type); the message must name both.
BAD = [
  ("grpo", "learning_rate", "0.001", TypeError),
  ("grpo", "learning_rate", None, TypeError),
  ("grpo", "fraction", "0.3", TypeError),
  ("grpo", "max_norm", "1", TypeError),
  ("grpo", "l2", "0.1", TypeError),
  ("grpo", "weight_decay", "0.1", TypeError),
  ("grpo", "b1", "0.9", TypeError),
  ("grpo", "b2", None, TypeError),
  ("grpo", "eps", [1e-8], TypeError),
  ("grpo", "b1", True, TypeError),
  ("grpo", "mu_dtype", "float8", TypeError),
  ("grpo", "nu_dtype", "int32", ValueError),
  ("grpo", "mu_format", "int4", ValueError),
  ("grpo", "error_feedback", "no", TypeError),
  ("grpo", "importance", "yes", TypeError),
  ("grpo", "adaptive", 1, TypeError),
  ("grpo", "nesterov", None, TypeError),
  ("grpo", "fused", "yes", TypeError),
  ("grpo", "sparsify", "TOPK", ValueError),
  ("grpo", "topk_method", None, ValueError),
  ("grpo", "min_size", "1024", TypeError),
  ("grpo", "seed", None, TypeError),
  ("grpo", "every", 2.5, ValueError),
  ("grpo", "sparsify_warmup_steps", "10", TypeError),
  ("grpo", "importance_order", "2", TypeError),
  ("grpo", "importance_decay", "0.9", TypeError),
  ("grpo", "min_weight", None, TypeError),
  ("grpo", "variance_coef", "0.1", TypeError),
  ("grpo", "variance_reduction", 1, ValueError),
  ("grpo", "variance_normalize", "False", TypeError),
  ("grpo", "freeze_threshold", "0.3", TypeError),
  ("grpo", "freeze_warmup_steps", None, TypeError),
  ("grpo", "frequency_weight", "0.5", TypeError),
  ("grpo", "filter_decay", "0.9", TypeError),
  ("grpo", "alpha", "0.7", TypeError),
  ("grpo", "threshold_scale", None, TypeError),
  ("scale_by_variance_lr", "coef", "0.1", TypeError),
  ("scale_by_variance_lr", "decay", None, TypeError),
  ("scale_by_variance_lr", "eps", "1e-12", TypeError),
  ("scale_by_variance_lr", "reduction", None, ValueError),
  ("scale_by_variance_lr", "normalize", "no", TypeError),
  ("scale_by_importance", "order", "2", TypeError),
  ("scale_by_importance", "decay", "0.9", TypeError),
  ("scale_by_importance", "min_weight", "0.1", TypeError),
  ("scale_by_importance", "max_weight", None, TypeError),
  ("top_k_mask", "fraction", "0.3", TypeError),
  ("top_k_mask", "fraction", None, TypeError),
  ("top_k_mask", "error_feedback", "no", TypeError),
  ("top_k_mask", "method", "Sampled", ValueError),
  ("top_k_mask", "frequency_weight", "0.1", TypeError),
  ("top_k_mask", "min_size", "0", TypeError),
  ("top_k_mask", "warmup_steps", None, TypeError),
  ("top_k_mask", "frequency_decay", "0.9", TypeError),
  ("top_k_mask", "seed", "0", TypeError),
  ("ema_threshold_mask", "alpha", "0.7", TypeError),
  ("ema_threshold_mask", "every", "100", TypeError),
  ("ema_threshold_mask", "scale", None, TypeError),
  ("ema_threshold_mask", "error_feedback", "no", TypeError),
  ("ema_threshold_mask", "min_size", 1.5, ValueError),
  ("scale_by_nesterov_adam_rms", "b1", "0.9", TypeError),
  ("scale_by_nesterov_adam_rms", "b2", None, TypeError),
  ("scale_by_nesterov_adam_rms", "eps", "1e-8", TypeError),
  ("scale_by_nesterov_adam_rms", "eps_root", None, TypeError),
  ("scale_by_nesterov_adam_rms", "adam_weight", "0.5", TypeError),
  ("scale_by_nesterov_adam_rms", "nesterov", "True", TypeError),
  ("scale_by_nesterov_adam_rms", "filter_decay", "0.9", TypeError),
  ("scale_by_nesterov_adam_rms", "mu_dtype", "float8", TypeError),
  ("scale_by_nesterov_adam_rms", "nu_dtype", jnp.int32, ValueError),
  ("scale_by_nesterov_adam_rms", "mu_dtype", 3, TypeError),
  ("scale_by_nesterov_adam_rms", "rms_bias_correction", 0, TypeError),
  ("scale_by_nesterov_adam_rms", "mu_format", "int4", ValueError),
  ("scale_by_nesterov_adam_rms", "nu_format", 8, ValueError),
  ("clip_with_l2", "max_norm", "1.0", TypeError),
  ("clip_with_l2", "max_norm", None, TypeError),
  ("clip_with_l2", "l2", "1e-4", TypeError),
  ("clip_with_l2", "l2", np.bool_(True), TypeError),
  ("freeze_below", "threshold", "0.3", TypeError),
  ("freeze_below", "decay", None, TypeError),
  ("freeze_below", "warmup_steps", "100", TypeError),
  ("zclip", "z_threshold", 0.0, ValueError),
  ("zclip", "z_threshold", "2.5", TypeError),
  ("zclip", "alpha", 1.0, ValueError),
  ("zclip", "warmup_steps", 0, ValueError),
  ("zclip", "warmup_steps", 2.5, ValueError),
  ("grpo", "zclip", -1.0, ValueError),
  ("grpo", "zclip_alpha", 1.5, ValueError),
]


@pytest.mark.parametrize(
  "factory, name, value, error",
  BAD,
  ids=[f"{f}-{n}={v!r}" for f, n, v, _ in BAD],
)
def test_wrong_type_is_refused_at_construction(factory, name, value, error):
  if factory == "grpo" and name == "learning_rate":
    call = lambda: go.grpo(value)
  else:
    call = lambda: FACTORIES[factory](**{name: value})
  with pytest.raises(error) as info:
    call()
  msg = str(info.value)
  assert re.search(rf"\b{name}\b", msg), msg
  assert repr(value) in msg, msg
  if factory == "grpo":
    assert msg.startswith("grpo: "), msg


def test_every_exported_factory_is_covered():
  exported = {
    name
    for name in go.__all__
    if callable(getattr(go, name))
    and name[0].islower()
    and name
    not in ("metrics", "frozen_mask", "importance_converged", "per_head")
  }
  # clip_mask_adam takes grpo()'s validated settings (built by grpo()).
  assert exported - {"clip_mask_adam"} == set(FACTORIES)
  assert {f for f, *_ in BAD} == set(FACTORIES)


def test_other_exported_functions_name_the_bad_argument():
  with pytest.raises(TypeError, match=r"axis must be an int; got '0'"):
    go.per_head(jnp.ones(4), "0", 2)
  with pytest.raises(TypeError, match=r"ndim must be an int; got None"):
    go.per_head(jnp.ones(4), 0, None)
  state = go.scale_by_importance().init({"w": jnp.ones(3)})
  with pytest.raises(TypeError, match=r"std_below must be .*got '0.05'"):
    go.importance_converged(state, "0.05")
  tx = go.freeze_below()
  state = tx.init({"a": jnp.ones(2), "b": jnp.ones(2)})
  with pytest.raises(ValueError, match="`like` has 1 leaves but"):
    go.frozen_mask(state, {"a": 0})


NUMBERS = [
  0.9,
  np.float32(0.9),
  np.float64(0.9),
  np.asarray(0.9),
  jnp.asarray(0.9),
  jnp.asarray(0.9, jnp.bfloat16),
]


@pytest.mark.parametrize("b1", NUMBERS, ids=lambda v: type(v).__name__)
def test_numbers_of_every_kind_are_accepted(b1):
  go.scale_by_nesterov_adam_rms(b1=b1)
  go.grpo(jnp.asarray(1e-3), b1=b1, min_size=np.int64(16), seed=jnp.asarray(0))
  go.top_k_mask(fraction=np.float32(0.5), min_size=jnp.asarray(4))
  go.grpo(optax.linear_schedule(0.0, 1e-3, 10), mu_dtype="bfloat16")
  go.grpo(1, nu_dtype=jnp.float32, mu_format="int8")


def test_traced_hyperparameters_pass_the_checks():
  params = {"w": jnp.ones((8, 8))}
  tx = optax.inject_hyperparams(go.grpo, hyperparam_dtype=jnp.float32)(
    learning_rate=1e-3, b1=0.9, fraction=0.5, min_size=16, seed=0
  )

  @jax.jit
  def step(params):
    state = tx.init(params)  # the factory runs on tracers here
    return tx.update(jax.tree.map(jnp.ones_like, params), state, params)[0]

  assert step(params)["w"].shape == (8, 8)


# -- the updates' tree against the state's ------------------------------------

PARAMS = {"layer": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}}

STAGES = {
  "grpo": lambda: go.grpo(min_size=0),
  "grpo_threshold": lambda: go.grpo(sparsify="threshold", min_size=0),
  "grpo_int8": lambda: go.grpo(mu_format="int8", nu_format="uint8"),
  "top_k_mask": lambda: go.top_k_mask(),
  "ema_threshold_mask": lambda: go.ema_threshold_mask(),
  "scale_by_nesterov_adam_rms": lambda: go.scale_by_nesterov_adam_rms(),
  "scale_by_variance_lr": lambda: go.scale_by_variance_lr(),
  "scale_by_importance": lambda: go.scale_by_importance(),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_leaf_of_another_shape_is_named(stage):
  tx = STAGES[stage]()
  who = "grpo" if stage.startswith("grpo") else stage
  bad = {"layer": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}}
  msg = (
    f"{who}: `updates` leaf ['layer']['w'] has shape (3, 4) but the state "
    "was built for (4, 4)"
  )
  with pytest.raises(ValueError, match=re.escape(msg)):
    tx.update(bad, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("stage", STAGES)
def test_a_missing_or_unknown_leaf_is_named(stage):
  tx = STAGES[stage]()
  state = tx.init(PARAMS)
  renamed = {"layer": {"w": jnp.ones((4, 4)), "c": jnp.ones(4)}}
  with pytest.raises(ValueError, match=re.escape("lack: ['layer']['c']")):
    tx.update(renamed, state, PARAMS)
  fewer = {"layer": {"w": jnp.ones((4, 4))}}
  with pytest.raises(ValueError, match=re.escape("lacks leaves of the params")):
    tx.update(fewer, state, PARAMS)


def test_the_chain_form_names_the_stage():
  tx = go.grpo(fused=False)
  bad = {"layer": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}}
  with pytest.raises(ValueError, match=r"top_k_mask: `updates` leaf \['layer"):
    tx.update(bad, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
  "tx",
  [go.clip_with_l2(l2=0.1), go.freeze_below(), go.scale_by_importance()],
  ids=["clip_with_l2", "freeze_below", "scale_by_importance"],
)
def test_params_of_another_shape_are_named(tx):
  grads = {"layer": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}}
  params = {"layer": {"w": jnp.ones((4, 3)), "b": jnp.ones(4)}}
  state = tx.init(grads)
  msg = "`updates` leaf ['layer']['w'] has shape (4, 4) but `params` has (4, 3)"
  with pytest.raises(ValueError, match=re.escape(msg)):
    tx.update(grads, state, params)


# -- dtypes as optax gives them -----------------------------------------------

DTYPES = [
  (jnp.bfloat16, jnp.float32),
  (jnp.float32, jnp.bfloat16),
  (jnp.bfloat16, jnp.bfloat16),
  (jnp.float16, jnp.float32),
  (jnp.float16, jnp.float16),
]


def _update_dtype(tx, grad_dtype, param_dtype):
  params = {"w": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32)}
  params = jax.tree.map(lambda p: p.astype(param_dtype), params)
  grads = jax.tree.map(lambda p: (0.1 * p + 0.01).astype(grad_dtype), params)

  def two_steps(grads, params):
    state = tx.init(params)
    for _ in range(2):
      updates, state = tx.update(grads, state, params)
    return updates

  # Dtypes are decided when tracing: eval_shape gives those of a run without
  # compiling or running it.
  return jax.eval_shape(two_steps, grads, params)["w"].dtype


@pytest.mark.parametrize("grad_dtype, param_dtype", DTYPES)
def test_update_dtypes_are_optax_adams(grad_dtype, param_dtype):
  want = {
    _update_dtype(tx, grad_dtype, param_dtype)
    for tx in (
      optax.adam(1e-3),
      optax.nadam(1e-3),
      optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    )
  }
  assert len(want) == 1
  want = want.pop()
  for name, tx in {
    "grpo": go.grpo(1e-3, min_size=0),
    "grpo_dense": go.grpo(1e-3, sparsify=None),
    "grpo_threshold": go.grpo(1e-3, sparsify="threshold", min_size=0),
    "grpo_chain": go.grpo(1e-3, min_size=0, fused=False),
    "grpo_chain_all": go.grpo(
      1e-3,
      min_size=0,
      fused=False,
      importance=True,
      variance_coef=0.1,
      freeze_threshold=0.1,
    ),
    "adam_room": go.scale_by_nesterov_adam_rms(),
  }.items():
    assert _update_dtype(tx, grad_dtype, param_dtype) == want, name


@pytest.mark.parametrize("grad_dtype, param_dtype", DTYPES)
def test_stateful_rooms_follow_the_params_dtype(grad_dtype, param_dtype):
  # The dtype of optax.trace (a momentum that follows the params).
  want = _update_dtype(optax.trace(0.9), grad_dtype, param_dtype)
  for tx in (
    go.top_k_mask(min_size=0),
    go.ema_threshold_mask(),
    go.scale_by_variance_lr(),
    go.scale_by_importance(),
  ):
    assert _update_dtype(tx, grad_dtype, param_dtype) == want


# -- every public function, by its signature ----------------------------------
# Each public function of grpo_optax and grpo_optax.training is called with a
# wrong value for one argument at a time: a string or a bool where a number
# goes, a string or a number where a bool goes, None where None is not the
# default, a number where a choice (a string) goes, an unknown dtype. It must
# raise TypeError or ValueError naming the argument, what it expects ("must
# be ...") and the value, before any work. A new public function is covered
# by its signature; one with required arguments needs an entry in REQUIRED.

from grpo_optax import training  # noqa: E402  pylint: disable=g-import-not-at-top

_PARAMS = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}


def _loss(params, batch):
  del batch  # unused
  return jnp.sum(params["w"] ** 2)


def _required():
  tx = optax.sgd(0.1)
  mesh = jax.make_mesh((1,), ("data",))
  stack = dict(embed_fn=_loss, layer_fn=_loss, head_fn=_loss)
  return {
    "importance_converged": dict(
      opt_state=go.scale_by_importance().init(_PARAMS)
    ),
    "per_head": dict(entropy=jnp.ones((2, 4)), axis=0, ndim=2),
    "data_parallel": dict(loss_fn=_loss, tx=tx, mesh=mesh),
    "data_parallel_step": dict(loss_fn=_loss, tx=tx, mesh=mesh),
    "local_steps_step": dict(loss_fn=_loss, tx=tx, mesh=mesh, local_steps=2),
    "hierarchical_step": dict(loss_fn=_loss, tx=tx),
    "frozen_train_step": dict(loss_fn=_loss, tx=tx),
    "train_step": dict(loss_fn=_loss, tx=tx),
    "layerwise_train_step": dict(tx=tx, **stack),
    "stacked_loss_fn": stack,
    "init_exchange": dict(params=_PARAMS),
    "int8_levels": dict(num_replicas=2),
    "ring_send_bytes": dict(kind="all-reduce", size=64.0, group=2),
    "round_traffic_per_step": dict(compiled="", local_steps=2),
    "sparse_pmean": dict(grads=_PARAMS, residual=None, axis_name="data"),
    "exchange_mean": dict(
      tree=_PARAMS, residual=None, axis_name="data", num_replicas=2
    ),
    "outer_step": dict(
      outer_params=_PARAMS,
      local_params=_PARAMS,
      outer_opt_state=optax.sgd(0.7).init(_PARAMS),
      axis_name="data",
      outer_tx=optax.sgd(0.7),
    ),
    "default_is_core": dict(path="layers/0/mlp/w"),
  }


def _public_functions():
  out = {}
  for module in (go, training):
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj):
        out[f"{module.__name__}.{name}"] = obj
  return out


def _kind(param: inspect.Parameter) -> str | None:
  """What an argument takes, read off its annotation and default."""
  note, default = str(param.annotation), param.default
  if note == "Any":
    return None  # a tree, a rule, an array: no type to refuse here
  if param.name.endswith("_dtype"):
    return "dtype"
  if param.name.endswith("_format"):
    return "format"
  if isinstance(default, bool) or re.fullmatch(r"bool( \| None)?", note):
    return "bool"
  if (
    isinstance(default, (int, float))
    or re.search(r"\b(float|int)\b", note)
    and "Any" not in note
    and "Array" not in note
  ):
    return "number"
  if isinstance(default, str):
    return "choice"
  return None


_BAD = {
  "number": ["0.5", True, [1.0]],
  "bool": ["yes", 1],
  "choice": [1, ("dense",)],
  "dtype": ["float8", "int32"],
  "format": ["int4", 8],
}


def _bad_calls():
  for path, fn in sorted(_public_functions().items()):
    for param in inspect.signature(fn).parameters.values():
      kind = _kind(param)
      if kind is None:
        continue
      values = list(_BAD[kind])
      none_ok = param.default is None or "None" in str(param.annotation)
      if not none_ok and kind in ("number", "bool", "choice"):
        values.append(None)  # None where it is not allowed
      for value in values:
        yield pytest.param(
          path,
          param.name,
          value,
          id=f"{path.split('.')[-1]}-{param.name}={value!r}",
        )


BAD_CALLS = list(_bad_calls())


def test_the_signatures_cover_the_public_functions():
  covered = {
    path.split(".")[-1] for path, _, _ in (p.values for p in BAD_CALLS)
  }
  assert {
    "grpo",
    "top_k_mask",
    "clip_with_l2",
    "data_parallel",
    "data_parallel_step",
    "sparse_pmean",
    "local_steps_step",
    "outer_step",
    "init_exchange",
    "hierarchical_step",
    "frozen_train_step",
    "train_step",
    "layerwise_train_step",
    "default_outer_optimizer",
    "int8_levels",
    "ring_send_bytes",
  } <= covered
  kinds = {
    (path.split(".")[-1], name): _kind(
      inspect.signature(_public_functions()[path]).parameters[name]
    )
    for path, name, _ in (p.values for p in BAD_CALLS)
  }
  assert kinds[("grpo", "learning_rate")] == "number"
  assert kinds[("grpo", "fused")] == "bool"
  assert kinds[("data_parallel_step", "exchange")] == "choice"
  assert kinds[("grpo", "mu_dtype")] == "dtype"
  # Every function with required arguments has them in REQUIRED.
  required = _required()
  for path, fn in _public_functions().items():
    missing = [
      p.name
      for p in inspect.signature(fn).parameters.values()
      if p.default is inspect.Parameter.empty
      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    name = path.split(".")[-1]
    if missing and any(
      c[0].endswith("." + name) for c in (p.values for p in BAD_CALLS)
    ):
      assert set(missing) <= set(required.get(name, {})), (path, missing)


@pytest.mark.parametrize("path, name, value", BAD_CALLS)
def test_every_public_function_refuses_a_wrong_type(path, name, value):
  fn = _public_functions()[path]
  kwargs = dict(_required().get(path.split(".")[-1], {}))
  kwargs[name] = value
  with pytest.raises((TypeError, ValueError)) as info:
    fn(**kwargs)
  msg = str(info.value)
  assert re.search(rf"(?<![\w.]){name}(?!\w)", msg), msg
  assert repr(value) in msg or repr(value).strip("'") in msg, msg
  assert "must" in msg, msg


# Transforms that neither keep params-shaped state nor read the params with
# their defaults, so that any updates tree is theirs to take (as
# optax.clip_by_global_norm's); with l2 > 0 clip_with_l2 reads the params.
TREE_FREE = {"clip_with_l2": go.clip_with_l2(l2=0.1)}
# Transforms whose state holds nothing per leaf and whose update reads no
# params (a global norm's statistics, as optax.clip_by_global_norm): any
# tree fits them.
ANY_TREE = {"zclip"}


def _transforms():
  """Every public factory that builds a transform from its defaults."""
  out = {}
  for name in go.__all__:
    fn = getattr(go, name)
    required = (
      [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty
      ]
      if inspect.isfunction(fn)
      else [None]
    )
    if not required and isinstance(fn(), optax.GradientTransformation):
      out[name] = TREE_FREE.get(name) or fn()
  return out


@pytest.mark.parametrize("name", sorted(_transforms()))
def test_every_transform_names_the_leaf_that_does_not_fit(name):
  tx = _transforms()[name]
  state = tx.init(PARAMS)
  bad = {"layer": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}}
  if name in ANY_TREE:
    out, _ = tx.update(bad, state, PARAMS)
    assert jax.tree.structure(out) == jax.tree.structure(bad)
    return
  with pytest.raises(ValueError, match=re.escape("leaf ['layer']['w'] has")):
    tx.update(bad, state, PARAMS)
  renamed = {"layer": {"w": jnp.ones((4, 4)), "c": jnp.ones(4)}}
  with pytest.raises(ValueError, match=re.escape("['layer']['c']")):
    tx.update(renamed, state, PARAMS)


def test_the_transforms_are_found():
  assert {
    "grpo",
    "top_k_mask",
    "ema_threshold_mask",
    "scale_by_nesterov_adam_rms",
    "scale_by_variance_lr",
    "scale_by_importance",
    "freeze_below",
    "clip_with_l2",
  } <= set(_transforms())
