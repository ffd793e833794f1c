"""grpo() on sharded parameters: a 2x4 ("data", "model") mesh of 8 CPU devices.

The layout has a leaf of each kind a large model shards: rows sharded (FSDP
over ``data``), columns sharded, tensor parallel (both axes), a 3-D stack of
layers with its last axis sharded, and small replicated leaves (a vector of
fewer than 1,024 entries and a scalar). Every test goes through the public
API only (``grpo_optax.grpo``, ``grpo_optax.metrics``, the optax and Flax
recipes), never through the state's field names, and ``optax.adam`` runs
through the same checks as the positive control.

The state is built as a training loop builds it, ``tx.init(params)``
eagerly: a jitted ``init`` without ``out_shardings`` places arrays created
from nothing (``jnp.zeros_like``) replicated or on one device, for
``optax.adam`` as well, and on an Explicit mesh without ``jax.set_mesh`` it
fails; the sharded ``init`` under ``jit`` is the recipe of
``test_map_params_recipe_lays_out_the_state``.
"""

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import grpo_optax
from benchmarks import sharding as bench
from grpo_optax import training

# Distinct shapes, so that a state leaf is matched to its parameter by shape.
LAYOUT = {
  "rows": ((128, 32), P("data", None)),
  "cols": ((32, 128), P(None, "model")),
  "tp": ((64, 64), P("data", "model")),
  "stacked": ((3, 16, 64), P(None, None, "model")),
  "bias": ((512,), P()),
  "scale": ((), P()),
}
MODES = {
  "adam": None,  # the positive control: optax.adam(lr)
  "dense": dict(sparsify=None),
  "topk": {},
  "threshold": dict(sparsify="threshold"),
  "article": dict(grpo_optax.ARTICLE_DEFAULTS),
  "freeze": dict(freeze_threshold=0.3, freeze_warmup_steps=2),
}
MASKED = ("topk", "threshold", "article", "freeze")
_GRPO_DEFAULTS = {k.keyword: k.default for k in grpo_optax.WIRING}
# Dense variants of the masked modes (comparable to float tolerance), and the
# masks alone (lr 1, no clip, no Adam: the update is minus the kept part).
VARIANTS = dict(
  MODES,
  article_dense=dict(grpo_optax.ARTICLE_DEFAULTS, sparsify=None),
  freeze_dense=dict(sparsify=None, freeze_threshold=0.3, freeze_warmup_steps=2),
  mask_topk=dict(sparsify="topk", adaptive=False, max_norm=None),
  mask_threshold=dict(sparsify="threshold", adaptive=False, max_norm=None),
)
AXIS_TYPES = list(bench.AXIS_TYPES)
# (axis type, inside jax.set_mesh): every mode runs on the first two, the
# dense and the default mode on all four.
MAIN_CONTEXTS = [("auto", False), ("explicit", True)]
OTHER_CONTEXTS = [("auto", True), ("explicit", False)]
GRID = [(m, c) for m in MODES for c in MAIN_CONTEXTS] + [
  (m, c) for m in ("adam", "dense", "topk") for c in OTHER_CONTEXTS
]
STEPS = 3


def _ctx_id(ctx):
  return ctx[0] + ("-set_mesh" if ctx[1] else "")


def _tiered(cases, fast, ids=None):
  """Pytest params: those whose id is in ``fast`` run in the fast tier, the
  others are marked slow (compiling each mode on each mesh takes seconds).
  """
  ids = ids or ["-".join(map(str, c)) for c in cases]
  return [
    pytest.param(*c, id=i, marks=() if i in fast else pytest.mark.slow)
    for c, i in zip(cases, ids)
  ]


def _tx(name, lr=None):
  kw = VARIANTS[name]
  if lr is None:
    lr = 1.0 if name.startswith("mask_") else 1e-2
  return optax.adam(lr) if kw is None else grpo_optax.grpo(lr, **kw)


def _shardings(mesh):
  return {k: NamedSharding(mesh, spec) for k, (_, spec) in LAYOUT.items()}


def _values(seed):
  """Host arrays of the layout's shapes (normal, scaled per leaf)."""
  rng = np.random.default_rng(seed)
  return {
    k: (rng.normal(size=shape) * (1 + i)).astype(np.float32)
    for i, (k, (shape, _)) in enumerate(LAYOUT.items())
  }


GRADS = [_values(10 + t) for t in range(STEPS)]


def _place(tree, shardings):
  return {k: jax.device_put(v, shardings[k]) for k, v in tree.items()}


def _mesh_context(mesh, with_mesh):
  return jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext()


def _param_sized(state, params):
  """(path, state leaf, matching param) for every state leaf shaped like a
  sharded parameter.

  Replicated parameters are left out: where an array created from nothing
  lands is JAX's choice (replicated, or one device).
  """
  by_shape = {
    p.shape: (k, p)
    for k, p in params.items()
    if not p.sharding.is_fully_replicated
  }
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    shape = getattr(leaf, "shape", None)
    if shape in by_shape:
      out.append((jax.tree_util.keystr(path),) + (leaf, by_shape[shape][1]))
  return out


def _assert_same_shardings(tree, params, what):
  for k, p in params.items():
    assert tree[k].sharding.is_equivalent_to(p.sharding, p.ndim), (
      f"{what}[{k!r}] has {tree[k].sharding}, the param has {p.sharding}"
    )


def _assert_state_shardings(state, params):
  matched = _param_sized(state, params)
  for path, leaf, p in matched:
    assert leaf.sharding.is_equivalent_to(p.sharding, p.ndim), (
      f"state leaf {path} of shape {leaf.shape} has {leaf.sharding}, its "
      f"parameter has {p.sharding}"
    )
  return matched


def _metric(state, word):
  """The one scalar of ``metrics(state)`` whose key contains ``word``."""
  found = {
    k: v
    for k, v in grpo_optax.metrics(state).items()
    if word in k and jnp.ndim(v) == 0
  }
  assert len(found) == 1, (word, sorted(grpo_optax.metrics(state)))
  return float(next(iter(found.values())))


@functools.cache
def _jitted(name):
  tx = _tx(name)
  return tx, jax.jit(tx.update)


@functools.cache
def _trajectory(name, axis_type=None, with_mesh=True):
  """STEPS jitted updates of VARIANTS[name] from the same start.

  On one device (``axis_type=None``) or on the 2x4 mesh of ``axis_type``;
  the state from ``tx.init(params)``, eagerly (module docstring). Cached:
  the tests of one setting share its compiled update.

  Returns:
    (params at the start, [updates], [states] after each step, final params)
  """
  tx, update = _jitted(name)
  if axis_type is None:
    device = jax.devices()[0]
    place = lambda t: {k: jax.device_put(v, device) for k, v in t.items()}
    context = contextlib.nullcontext()
  else:
    mesh = bench.make_mesh(axis_type)
    place = lambda t: _place(t, _shardings(mesh))
    context = _mesh_context(mesh, with_mesh)
  with context:
    params = start = place(_values(0))
    state = tx.init(params)
    updates, states = [], [state]
    for g in GRADS:
      u, state = update(place(g), state, params)
      params = optax.apply_updates(params, u)
      updates.append(u)
      states.append(state)
  return start, updates, states, params


# -- (a) it runs, (c) it keeps the params' shardings -------------------------


@pytest.mark.parametrize(
  "mode,ctx",
  _tiered(
    GRID,
    {"adam-auto", "dense-explicit-set_mesh", "topk-explicit-set_mesh"},
    [f"{m}-{_ctx_id(c)}" for m, c in GRID],
  ),
)
def test_update_runs_and_keeps_the_params_shardings(mode, ctx):
  start, updates, states, params = _trajectory(mode, *ctx)
  # Adam's mu and nu at least, in every mode.
  assert len(_assert_state_shardings(states[0], start)) >= 2 * len(
    _param_sized(start, start)
  )
  for u, state in zip(updates, states[1:]):
    _assert_same_shardings(u, start, "updates")
    _assert_state_shardings(state, start)
  _assert_same_shardings(params, start, "params")
  for k, u in updates[-1].items():
    assert np.all(np.isfinite(np.asarray(u))), k
  assert any(np.any(np.asarray(u) != 0) for u in updates[-1].values())


# -- (b) no all-gather, collectives beyond Adam's <= 1% of the param bytes ---


@pytest.fixture(scope="module")
def adam_traffic():
  """Adam's collective bytes per device on the benchmark layout, per mesh."""
  out = {}
  for axis_type in bench.AXIS_TYPES:
    mesh = bench.make_mesh(axis_type)
    with jax.set_mesh(mesh):
      r = bench.measure(
        optax.adam(1e-3), bench.make_params(mesh, bench.layout())
      )
    assert r["compiles"], r
    out[axis_type] = r["collective_bytes"]
  return out


COLLECTIVES_GRID = [(m, c) for m, c in GRID if m != "adam"]


@pytest.mark.parametrize(
  "mode,ctx",
  _tiered(
    COLLECTIVES_GRID,
    {"topk-auto", "topk-explicit-set_mesh"},
    [f"{m}-{_ctx_id(c)}" for m, c in COLLECTIVES_GRID],
  ),
)
def test_update_has_no_all_gather_and_scalar_sized_collectives(
  mode, ctx, adam_traffic
):
  """On the benchmark's 4.2M-parameter layout (compiled, not run)."""
  axis_type, with_mesh = ctx
  mesh = bench.make_mesh(axis_type)
  with _mesh_context(mesh, with_mesh):
    params = bench.make_params(mesh, bench.layout())
    compiled = bench.compile_update(_tx(mode, 1e-3), params)
  ops = training.collective_ops(compiled)
  gathers = [(kind, size) for kind, size, _ in ops if kind == "all-gather"]
  assert not gathers, f"{mode}: all-gathers of {gathers} bytes"
  extra = training.ring_traffic(compiled)["total"] - adam_traffic[axis_type]
  budget = 0.01 * bench.param_bytes_per_device(params)
  assert extra <= budget, (
    f"{mode}: {extra:.0f} collective bytes per device beyond Adam's, more "
    f"than 1% of the {budget * 100:.0f} parameter bytes per device; "
    f"ops {ops}"
  )


# -- exact top-k must see a whole leaf: it says so --------------------------


def _exact_topk_outcome(params, grads):
  """(ValueError or None, UserWarning messages) of building and running."""
  tx = grpo_optax.grpo(1e-2, topk_method="exact")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      state = tx.init(params)
      jax.block_until_ready(jax.jit(tx.update)(grads, state, params))
      error = None
    except ValueError as e:
      error = e
  return error, [
    str(w.message) for w in caught if issubclass(w.category, UserWarning)
  ]


@pytest.mark.parametrize(
  "axis_type", _tiered([("auto",), ("explicit",)], {"auto"})
)
def test_exact_topk_warns_or_refuses_on_a_sharded_leaf(axis_type):
  mesh = bench.make_mesh(axis_type)
  shardings = _shardings(mesh)
  with jax.set_mesh(mesh):
    error, messages = _exact_topk_outcome(
      _place(_values(0), shardings), _place(_values(1), shardings)
    )
  named = [m for m in messages if "exact" in m]
  assert (error is not None and "exact" in str(error)) or named, (
    f"topk_method='exact' on sharded leaves neither raised a ValueError "
    f"naming 'exact' ({error!r}) nor warned ({messages})"
  )


@pytest.mark.slow
def test_exact_topk_is_silent_on_one_device():
  device = jax.devices()[0]
  params = {k: jax.device_put(v, device) for k, v in _values(0).items()}
  grads = {k: jax.device_put(v, device) for k, v in _values(1).items()}
  error, messages = _exact_topk_outcome(params, grads)
  assert error is None
  assert not [m for m in messages if "exact" in m], messages


# -- (d) the sharded result equals the unsharded one -------------------------

# The main contexts of each mesh type (the trajectories of GRID are reused).
MESHES = {"auto": False, "explicit": True}
DENSE = ("adam", "dense", "article_dense", "freeze_dense")


@pytest.mark.parametrize(
  "mode,axis_type",
  _tiered([(m, a) for m in DENSE for a in AXIS_TYPES], {"dense-explicit"}),
)
def test_dense_sharded_updates_equal_unsharded(mode, axis_type):
  _, ref, ref_states, _ = _trajectory(mode)
  _, got, states, _ = _trajectory(mode, axis_type, MESHES[axis_type])
  for t, (u, r) in enumerate(zip(got, ref)):
    for k in LAYOUT:
      np.testing.assert_allclose(
        np.asarray(u[k]),
        np.asarray(r[k]),
        rtol=2e-5,
        atol=1e-8,
        err_msg=f"{mode} step {t} leaf {k}",
      )
  want = grpo_optax.metrics(ref_states[-1])
  have = grpo_optax.metrics(states[-1])
  assert set(have) == set(want)
  for key, value in want.items():
    if jnp.ndim(value) == 0:
      np.testing.assert_allclose(
        float(have[key]), float(value), rtol=1e-4, atol=1e-7, err_msg=key
      )


@pytest.mark.parametrize(
  "mode,axis_type",
  _tiered([(m, a) for m in MASKED for a in AXIS_TYPES], {"topk-explicit"}),
)
def test_masked_sharded_kept_fraction_matches_unsharded(mode, axis_type):
  ref = _metric(_trajectory(mode)[2][-1], "kept")
  got = _metric(_trajectory(mode, axis_type, MESHES[axis_type])[2][-1], "kept")
  # ~1,024 sampled entries per leaf: a kept-fraction error of ~0.015 each.
  assert abs(got - ref) <= 0.05, (mode, got, ref)
  if mode != "threshold":
    want = MODES[mode].get("fraction", _GRPO_DEFAULTS["fraction"])
    assert abs(got - want) <= 0.05, (mode, got, want)


@pytest.mark.parametrize(
  "mode,axis_type",
  _tiered(
    [(m, a) for m in ("mask_topk", "mask_threshold") for a in AXIS_TYPES], set()
  ),
)
def test_masked_error_feedback_loses_nothing_when_sharded(mode, axis_type):
  """sum_t g_t = sum_t (-u_t) + r_T: ||sum g + sum u|| is the residual norm
  that metrics() reports, and the kept fraction matches one device's.
  """
  _, ref, _, _ = _trajectory(mode)
  _, got, states, _ = _trajectory(mode, axis_type, MESHES[axis_type])
  diff_sq = 0.0
  for k in LAYOUT:
    total = sum(np.asarray(g[k], np.float64) for g in GRADS)
    sent = -sum(np.asarray(u[k], np.float64) for u in got)
    diff_sq += float(np.sum((total - sent) ** 2))
  assert diff_sq > 0  # something was held back
  np.testing.assert_allclose(
    _metric(states[-1], "residual"), np.sqrt(diff_sq), rtol=1e-4
  )
  for k in ("rows", "cols", "tp", "stacked"):
    kept = np.mean(np.asarray(got[-1][k]) != 0)
    kept_ref = np.mean(np.asarray(ref[-1][k]) != 0)
    assert abs(kept - kept_ref) <= 0.05, (k, kept, kept_ref)
  # Leaves under min_size (1,024) pass dense: the bias and the scalar.
  for k in ("bias", "scale"):
    np.testing.assert_allclose(np.asarray(got[-1][k]), -GRADS[-1][k], rtol=1e-6)


@pytest.mark.parametrize(
  "stage,axis_type",
  _tiered(
    [(m, a) for m in ("top_k_mask", "ema_threshold_mask") for a in AXIS_TYPES],
    {"top_k_mask-auto"},
  ),
)
def test_mask_stage_on_sharded_leaves_loses_nothing(stage, axis_type):
  """The chain stages: sum_t out_t + residual_T == sum_t g_t on sharded
  leaves, out and residual keep the shardings, and no all-gather.
  """
  make = {
    "top_k_mask": lambda: grpo_optax.top_k_mask(
      0.3, method="sampled", min_size=1024
    ),
    "ema_threshold_mask": lambda: grpo_optax.ema_threshold_mask(),
  }[stage]
  mesh = bench.make_mesh(axis_type)
  with jax.set_mesh(mesh):
    shardings = _shardings(mesh)
    tx = make()
    state = tx.init(_place(_values(0), shardings))
    update = jax.jit(tx.update)
    outs = []
    for g in GRADS:
      out, state = update(_place(g, shardings), state)
      _assert_same_shardings(out, _place(g, shardings), "out")
      _assert_same_shardings(state.residual, _place(g, shardings), "residual")
      outs.append(out)
    ops = training.collective_ops(
      update.lower(_place(GRADS[0], shardings), state).compile()
    )
  assert not [op for op in ops if op[0] == "all-gather"], ops
  for k in LAYOUT:
    total = sum(np.asarray(g[k], np.float64) for g in GRADS)
    sent = sum(np.asarray(o[k], np.float64) for o in outs)
    np.testing.assert_allclose(
      sent + np.asarray(state.residual[k]),
      total,
      rtol=1e-5,
      atol=1e-5,
      err_msg=k,
    )


@pytest.mark.parametrize(
  "axis_type", _tiered([(a,) for a in AXIS_TYPES], {"explicit"})
)
def test_importance_metrics_of_a_laid_out_state(axis_type):
  """metrics() on a state laid out as the params, without jax.set_mesh:
  eagerly (concrete sharded arrays, as a training loop logs them) and under
  jit it gives one device's values (the ``weights`` sample entry for
  entry), and the jitted metrics gather the samples only (<= 1,024 entries
  of a leaf), never a leaf. The update itself has no all-gather.
  """
  tx = grpo_optax.scale_by_importance()
  device = jax.devices()[0]
  one = {k: jax.device_put(v, device) for k, v in _values(0).items()}
  state = tx.init(one)
  _, state = jax.jit(tx.update)(_values(1), state, one)
  want = grpo_optax.metrics(state)

  shardings = _shardings(bench.make_mesh(axis_type))
  params = _place(_values(0), shardings)
  update = jax.jit(tx.update)
  state = tx.init(params)
  grads = _place(_values(1), shardings)
  _, state = update(grads, state, params)
  ops = training.collective_ops(update.lower(grads, state, params).compile())
  assert not [op for op in ops if op[0] == "all-gather"], ops
  _assert_state_shardings(state, params)
  jitted = jax.jit(grpo_optax.metrics)
  ops = training.collective_ops(jitted.lower(state).compile())
  assert all(n <= 1024 * 4 for kind, n, _ in ops if kind == "all-gather"), ops
  for have in (grpo_optax.metrics(state), jitted(state)):
    assert set(have) == set(want)
    for key, value in want.items():
      np.testing.assert_allclose(
        np.asarray(have[key]), np.asarray(value), rtol=1e-5, err_msg=key
      )


# -- (e) optax's recipe for the state's shardings ----------------------------


def _recipe_shardings(tx, params, shardings, mesh):
  replicated = NamedSharding(mesh, P())
  return optax.tree.map_params(
    tx,
    lambda _, sh: sh,
    jax.eval_shape(tx.init, params),
    shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )


@pytest.mark.parametrize(
  "mode,axis_type",
  _tiered([(m, a) for m in MODES for a in AXIS_TYPES], {"topk-auto"}),
)
def test_map_params_recipe_lays_out_the_state(mode, axis_type):
  mesh = bench.make_mesh(axis_type)
  shardings = _shardings(mesh)
  with jax.set_mesh(mesh):
    params = _place(_values(0), shardings)
    tx = _tx(mode)
    state_shardings = _recipe_shardings(tx, params, shardings, mesh)
    state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    _assert_state_shardings(state, params)
    update = jax.jit(tx.update, out_shardings=(shardings, state_shardings))
    for g in GRADS:
      updates, state = update(_place(g, shardings), state, params)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in updates.values())


# -- (f) nnx.Optimizer on a model sharded with nnx.with_partitioning --------


def _nnx_model(rngs):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Layout(nnx.Module):
    def __init__(self, rngs):
      for i, (name, (shape, spec)) in enumerate(LAYOUT.items()):
        init = nnx.with_partitioning(
          nnx.initializers.normal(1.0 + i),
          tuple(spec) + (None,) * (len(shape) - len(spec)),
        )
        setattr(self, name, nnx.Param(init(rngs.params(), shape)))

    def loss(self, target):
      return sum(
        jnp.sum(jnp.sin(getattr(self, k)[...]) * target[k]) for k in LAYOUT
      )

  return Layout(rngs)


NNX_GRID = [(m, "auto") for m in MODES] + [
  ("dense", "explicit"),
  ("topk", "explicit"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,axis_type", NNX_GRID)
def test_nnx_optimizer_on_a_sharded_model(mode, axis_type):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  mesh = bench.make_mesh(axis_type)
  shardings = _shardings(mesh)
  with jax.set_mesh(mesh):
    model = _nnx_model(nnx.Rngs(0))
    for k in LAYOUT:
      assert getattr(model, k)[...].sharding.is_equivalent_to(
        shardings[k], len(LAYOUT[k][0])
      ), k
    optimizer = nnx.Optimizer(model, _tx(mode), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, target):
      loss, grads = nnx.value_and_grad(lambda m: m.loss(target))(model)
      optimizer.update(model, grads)
      return loss

    target = _place(_values(3), shardings)
    before = {k: np.asarray(getattr(model, k)[...]) for k in LAYOUT}
    for _ in range(STEPS):
      loss = step(model, optimizer, target)
    assert np.isfinite(float(loss))
    for k in LAYOUT:
      value = getattr(model, k)[...]
      assert value.sharding.is_equivalent_to(shardings[k], value.ndim), k
    assert any(
      not np.array_equal(before[k], np.asarray(getattr(model, k)[...]))
      for k in LAYOUT
    )


# -- (g) orbax: saved on 8 devices, restored on 4 ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_orbax_restores_onto_four_devices_and_training_continues(
  mode, tmp_path
):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mesh8 = bench.make_mesh("auto")
  mesh4 = bench.make_mesh("auto", devices=jax.devices()[:4], shape=(2, 2))
  sh8, sh4 = _shardings(mesh8), _shardings(mesh4)
  tx, update = _jitted(mode)
  _, _, states, params8 = _trajectory(mode, "auto", False)
  state8 = states[-1]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state8)
  checkpointer.wait_until_finished()

  params4 = _place(jax.tree.map(np.asarray, params8), sh4)
  # The state's layout on 4 devices: tx.init's, scalars replicated.
  layout4 = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape,
      x.dtype,
      sharding=x.sharding
      if isinstance(x.sharding, NamedSharding)
      else NamedSharding(mesh4, P()),
    ),
    tx.init(params4),
  )
  restored = checkpointer.restore(tmp_path / "state", layout4)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state8)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert {d for x in jax.tree.leaves(restored) for d in x.devices()} <= set(
    jax.devices()[:4]
  )

  g = _values(99)
  u4, next4 = update(_place(g, sh4), restored, params4)
  u8, next8 = update(_place(g, sh8), state8, params8)
  _assert_same_shardings(u4, params4, "updates on 4 devices")
  # The unrestored state moved onto the same 4 devices gives the same step.
  moved = jax.tree.map(
    lambda x, y: jax.device_put(np.asarray(x), y.sharding), state8, layout4
  )
  u4_moved, _ = update(_place(g, sh4), moved, params4)
  for k in LAYOUT:
    np.testing.assert_allclose(
      np.asarray(u4[k]),
      np.asarray(u4_moved[k]),
      rtol=1e-6,
      atol=1e-9,
      err_msg=k,
    )
    if mode in ("adam", "dense"):  # the same step as on 8 devices
      np.testing.assert_allclose(
        np.asarray(u4[k]), np.asarray(u8[k]), rtol=2e-5, atol=1e-8, err_msg=k
      )
  if mode in MASKED:  # a mask drawn on other shards keeps as much
    assert abs(_metric(next4, "kept") - _metric(next8, "kept")) <= 0.05


# -- (h) data_parallel_step with FSDP-sharded params -------------------------


def _dp_params():
  rng = np.random.default_rng(0)
  return {
    "w1": (rng.normal(size=(32, 64)) / 6).astype(np.float32),
    "b1": np.zeros(64, np.float32),
    "w2": (rng.normal(size=(64, 8)) / 8).astype(np.float32),
  }


def _dp_loss(params, batch):
  x, y = batch
  return jnp.mean(
    (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2
  )


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_data_parallel_step_with_fsdp_params_within_a_node(axis_type):
  """FSDP within a node ("local"), the sparse exchange across ("node"): the
  params keep their FSDP shardings, and the steps equal those of the same
  data_parallel_step on replicated params.
  """
  t = bench.AXIS_TYPES[axis_type]
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(t, t))
  specs = {"w1": P("local", None), "b1": P(), "w2": P(None, "local")}
  fsdp = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  rng = np.random.default_rng(1)
  batches = [
    (
      rng.normal(size=(32, 32)).astype(np.float32),
      rng.normal(size=(32, 8)).astype(np.float32),
    )
    for _ in range(3)
  ]

  def run(params):
    dp = training.data_parallel_step(
      _dp_loss,
      grpo_optax.grpo(1e-2, sparsify=None),
      mesh,
      axis="node",
      dense_axis="local",
      exchange="all_gather",
      fraction=0.3,
    )
    state = dp.init(params)
    losses = []
    for batch in batches:
      state, loss = dp.step(state, batch)
      losses.append(float(loss))
    return state, losses

  ref_state, ref_losses = run(_dp_params())
  placed = _place(_dp_params(), fsdp)
  state, losses = run(placed)
  for k, p in state.params.items():
    assert p.sharding.is_equivalent_to(fsdp[k], p.ndim), (k, p.sharding)
  # Adam's mu and nu of w1 and w2 at least are sharded as their params.
  assert len(_assert_state_shardings(state.opt_state, placed)) >= 4
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for k in specs:
    np.testing.assert_allclose(
      np.asarray(state.params[k]),
      np.asarray(ref_state.params[k]),
      rtol=1e-5,
      atol=1e-7,
      err_msg=k,
    )


@pytest.mark.parametrize(
  "names,axis,dense_axis,spec",
  [
    (("node", "local"), "node", "local", P("node", None)),
    (("node", "local"), "node", "local", P("local", "node")),
    (("data",), "data", None, P("data", None)),
  ],
)
def test_data_parallel_step_refuses_params_sharded_over_the_exchange_axis(
  names, axis, dense_axis, spec
):
  """Every replica of the exchange holds the whole params: a leaf sharded
  over ``axis`` is refused by name, not silently replicated.
  """
  shape = (2, 4) if len(names) == 2 else (8,)
  mesh = jax.make_mesh(shape, names)
  dp = training.data_parallel_step(
    _dp_loss, optax.sgd(0.1), mesh, axis=axis, dense_axis=dense_axis
  )
  params = _dp_params()
  params["w1"] = jax.device_put(params["w1"], NamedSharding(mesh, spec))
  with pytest.raises(ValueError, match=r"`params`.*\(32, 64\).*`axis`"):
    dp.init(params)
