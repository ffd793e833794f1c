"""The optax contract, run over every transform registered in contract.CASES."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract import CASES
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Module scope: pytest runs a case's tests one after another (and so xdist's
# --dist load sends them to one worker, in chunks of consecutive tests), where
# they share the case's jitted step (see _jitted).
cases = pytest.mark.parametrize("case", CASES, ids=str, scope="module")


def _params(dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    "dense": {
      "kernel": jax.random.normal(k1, (16, 8), dtype),
      "bias": jax.random.normal(k2, (8,), dtype),
    },
    "scale": jnp.asarray(0.5, dtype),
    "embed": jax.random.normal(k3, (32, 4), dtype),
  }


def _grads(params, i):
  keys = jax.random.split(jax.random.key(100 + i), len(jax.tree.leaves(params)))
  keys = jax.tree.unflatten(jax.tree.structure(params), list(keys))
  return jax.tree.map(
    lambda p, k: (0.1 * p + jax.random.normal(k, p.shape, jnp.float32)).astype(
      p.dtype
    ),
    params,
    keys,
  )


_STEPS = {}  # case name -> (transform, step, its traces): see _jitted


def _jitted(name, fresh=False):
  """A case's transform, one jitted step and the list of its traces.

  ``step(g, s, p)`` returns the update, the new state and both again as the
  update gives them with unknown extra arguments (the same computation: XLA
  merges it with the first). The step is shared by this worker's tests of
  the case, which then reuse one compilation; ``fresh`` builds (and shares
  from then on) a new, untraced one.
  """
  if fresh or name not in _STEPS:
    tx = _BY_NAME[name].make()
    traces = []

    @jax.jit
    def step(g, s, p):
      traces.append(None)
      u, new_s = tx.update(g, s, p)
      extra = tx.update(g, s, p, unknown_arg=jnp.ones(3), another=None)
      return u, new_s, extra

    _STEPS[name] = tx, step, traces
  return _STEPS[name]


def _update(step):
  """The ``update(g, s, p) -> (u, new_s)`` of a step of :func:`_jitted`."""
  return lambda g, s, p: step(g, s, p)[:2]


_BY_NAME = {case.name: case for case in CASES}


def _run(tx, params, steps, update=None):
  state = tx.init(params)
  update = update or jax.jit(tx.update)
  outs = []
  for i in range(steps):
    u, state = update(_grads(params, i), state, params)
    outs.append(u)
    params = optax.apply_updates(params, u)
  return outs, state, params


def _dtypes(tree):
  return jax.tree.map(lambda x: (jnp.asarray(x).dtype, jnp.shape(x)), tree)


@cases
def test_no_recompilation(case):
  # The first test of a case (module-scoped parametrization): its fresh
  # step is the one the case's other tests share.
  tx, step, traces = _jitted(case.name, fresh=True)
  params = _params()
  state = tx.init(params)
  for i in range(3):
    u, state, _ = step(_grads(params, i), state, params)
    params = optax.apply_updates(params, u)
  assert len(traces) == 1


@cases
def test_unknown_extra_args_accepted(case):
  tx, step, _ = _jitted(case.name)
  params = _params()
  # The step's last output is the update given unknown_arg=jnp.ones(3) and
  # another=None.
  u1, _, (u2, _) = step(_grads(params, 0), tx.init(params), params)
  chex_equal(u1, u2)


def chex_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@cases
def test_inject_hyperparams_identical(case):
  params = _params()
  tx, step, _ = _jitted(case.name)
  plain, _, _ = _run(tx, params, 4, _update(step))
  injected_tx = optax.inject_hyperparams(
    case.factory, static_args=case.static_args
  )(**case.kwargs)
  injected, state, _ = _run(injected_tx, params, 4)
  for a, b in zip(plain, injected):
    jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5), a, b
    )
  assert isinstance(state, optax.InjectStatefulHyperparamsState)


@cases
def test_bf16_updates_and_state_dtypes_stable(case):
  params = _params(jnp.bfloat16)
  tx = case.make()
  state0 = tx.init(params)
  outs, state, new_params = _run(tx, params, 3)
  for u in outs:
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
  assert _dtypes(state0) == _dtypes(state)
  assert jax.tree.structure(state0) == jax.tree.structure(state)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new_params))


@cases
def test_state_survives_cond(case):
  tx = case.make()
  params = _params()
  state = tx.init(params)
  grads = _grads(params, 0)

  @jax.jit
  def f(pred, state):
    return jax.lax.cond(
      pred, lambda s: tx.update(grads, s, params)[1], lambda s: s, state
    )

  s_true = f(True, state)
  s_false = f(False, state)
  assert jax.tree.structure(s_true) == jax.tree.structure(state)
  assert _dtypes(s_true) == _dtypes(state)
  chex_equal(s_false, state)


@cases
def test_multisteps_zero_on_mini_steps(case):
  tx = optax.MultiSteps(case.make(), every_k_schedule=3)
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(6):
    u, state = update(_grads(params, i), state, params)
    norm = float(optax.tree.norm(u))
    if i % 3 != 2:
      assert norm == 0.0, i
    else:
      assert norm > 0.0, i


@cases
def test_init_on_shape_dtype_struct(case):
  tx = case.make()
  params = _params()
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  state = tx.init(abstract)
  expected = tx.init(params)
  assert _dtypes(state) == _dtypes(expected)
  shaped = jax.eval_shape(tx.init, abstract)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shaped) == jax.tree.map(
    lambda x: (jnp.shape(x), jnp.asarray(x).dtype), expected
  )


@cases
def test_map_params_is_noop(case):
  tx = case.make()
  params = _params()
  state = tx.init(params)
  mapped = optax.tree.map_params(tx, lambda x: x, state)
  chex_equal(mapped, state)
  # It reaches exactly the param-shaped leaves: build partition specs with it.
  specs = jax.tree.map(lambda _: P(), params)
  opt_specs = optax.tree.map_params(
    tx,
    lambda _, spec: spec,
    state,
    specs,
    transform_non_params=lambda _: "not a param",
  )
  n_param_like = len(
    [x for x in jax.tree.leaves(opt_specs) if isinstance(x, P)]
  )
  assert n_param_like == case.param_trees * len(jax.tree.leaves(params))


@cases
def test_empty_tree_and_scalar_leaves(case):
  tx = case.make()
  u, _ = jax.jit(tx.update)({}, tx.init({}), {})
  assert u == {}
  params = {"a": jnp.asarray(1.0), "b": jnp.asarray(-2.0)}
  state = tx.init(params)
  for i in range(3):
    u, state = tx.update(
      {"a": jnp.asarray(0.3 * i + 0.1), "b": jnp.asarray(-0.2)}, state, params
    )
  assert all(jnp.shape(x) == () for x in jax.tree.leaves(u))
  assert all(bool(jnp.isfinite(x)) for x in jax.tree.leaves(u))


@cases
def test_sharded_params_give_sharded_updates(case):
  devices = np.array(jax.devices()[:8])
  assert devices.size == 8, "conftest forces 8 host devices"
  mesh = Mesh(devices, ("x",))
  params = _params()
  specs = {
    "dense": {"kernel": P("x", None), "bias": P("x")},
    "scale": P(),
    "embed": P("x", None),
  }
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  sharded = jax.device_put(params, shardings)
  tx, step, _ = _jitted(case.name)
  update = _update(step)
  state_ref = tx.init(params)
  state = jax.jit(tx.init)(sharded)
  for i in range(3):
    g_ref = _grads(params, i)
    u_ref, state_ref = update(g_ref, state_ref, params)
    u, state = update(jax.device_put(g_ref, shardings), state, sharded)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
      u,
      u_ref,
    )
    for leaf, sh in zip(jax.tree.leaves(u), jax.tree.leaves(shardings)):
      assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (leaf.sharding, sh)
    params = optax.apply_updates(params, u_ref)
    sharded = optax.apply_updates(sharded, u)


def _minimize(opt, loss, params, steps):
  state = opt.init(params)

  def body(_, carry):
    p, s = carry
    g = jax.grad(loss)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  params, _ = jax.jit(lambda c: jax.lax.fori_loop(0, steps, body, c))(
    (params, state)
  )
  return params


@cases
def test_converges_on_parabola(case):
  target = jnp.array([1.0, -1.0, 2.0])
  loss = lambda p: jnp.sum(jnp.square(p["x"] - target))
  params = _minimize(
    case.make_optimizer(), loss, {"x": jnp.array([-1.0, 10.0, 1.0])}, case.steps
  )
  np.testing.assert_allclose(params["x"], target, atol=5e-2)


@cases
def test_converges_on_rosenbrock(case):
  def loss(p):
    x, y = p["xy"][0], p["xy"][1]
    return (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2

  params = _minimize(
    case.make_optimizer(), loss, {"xy": jnp.array([-1.0, 1.5])}, 4 * case.steps
  )
  np.testing.assert_allclose(params["xy"], jnp.array([1.0, 1.0]), atol=0.1)


@cases
def test_odd_trees(case):
  """None leaves, zero-size leaves, tuples/lists and a 1-element leaf."""
  params = {
    "none": None,
    "empty": jnp.zeros((0, 3)),
    "one": jnp.ones((1,)),
    # float32, not the weak float of jnp.full(..., 2.0): a state built from a
    # weakly typed leaf changes type at the first step (a second compilation)
    "seq": (jnp.ones((2, 3)), [jnp.full((4,), 2.0, jnp.float32)]),
  }
  tx = case.make()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(3):
    g = jax.tree.map(lambda p, i=i: jnp.full_like(p, 0.1 * (i + 1)), params)
    u, state = update(g, state, params)
  assert jax.tree.structure(u) == jax.tree.structure(params)
  assert u["empty"].shape == (0, 3)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))


@cases
def test_state_serialization_roundtrip(case):
  """State survives a host round trip (pickle of NumPy arrays), as checkpoints do."""
  import pickle  # pylint: disable=g-import-not-at-top

  tx, step, _ = _jitted(case.name)
  update = _update(step)
  params = _params()
  state = tx.init(params)
  for i in range(2):
    _, state = update(_grads(params, i), state, params)
  restored = pickle.loads(pickle.dumps(jax.tree.map(np.asarray, state)))
  restored = jax.tree.map(jnp.asarray, restored)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  u1, _ = update(_grads(params, 5), state, params)
  u2, _ = update(_grads(params, 5), restored, params)
  chex_equal(u1, u2)


def _avals(tree):
  """Shape, dtype and weak type of every leaf (what lax.cond compares)."""
  return jax.tree.map(
    lambda x: (
      jnp.shape(x),
      jnp.asarray(x).dtype,
      jax.typeof(jnp.asarray(x)).weak_type,
    ),
    tree,
  )


@cases
def test_x64_state_avals_stable(case):
  """float64 params under jax_enable_x64: state keeps its dtypes (issue 13)."""
  with jax.enable_x64(True):
    params = _params(jnp.float64)
    tx = case.make()
    state0 = tx.init(params)
    update = jax.jit(tx.update)
    state = state0
    for i in range(2):
      u, state = update(_grads(params, i), state, params)
      assert _avals(state) == _avals(state0)
      assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(u))
    grads = _grads(params, 0)
    # optax's own optimizers allow this: both branches have equal types.
    new_state = jax.jit(
      lambda pred, s: jax.lax.cond(
        pred, lambda: tx.update(grads, s, params)[1], lambda: s
      )
    )(True, state0)
    assert _avals(new_state) == _avals(state0)


@cases
def test_inject_hyperparams_state_matches_plain(case):
  """Injected and plain states: same tree structure and dtypes (issue 13)."""
  params = _params()
  plain = case.make().init(params)
  injected = optax.inject_hyperparams(
    case.factory, static_args=case.static_args
  )(**case.kwargs)
  for init in (injected.init, jax.jit(injected.init)):
    inner = init(params).inner_state
    assert jax.tree.structure(inner) == jax.tree.structure(plain)
    assert _dtypes(inner) == _dtypes(plain)
  shaped = jax.eval_shape(injected.init, params).inner_state
  assert jax.tree.structure(shaped) == jax.tree.structure(plain)
