"""A run checkpointed with one form of ``grpo()`` continues with the other.

``grpo(fused=True)`` and ``grpo(fused=False)`` keep one :class:`GrpoState`
(``docs/design.md``, "One state for both forms"): saved with orbax after a
few updates of one form, restored into the other form's ``init`` layout,
the next five updates equal those of the uninterrupted run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax

ocp = pytest.importorskip("orbax.checkpoint")

# Leaves above and below the mask's min_size, a vector and a scalar.
SHAPES = {"w": (48, 40), "u": (40, 32), "b": (32,), "s": ()}

SETTINGS = {
  "default": {},
  "threshold": {"sparsify": "threshold", "every": 2},
  "article": dict(grpo_optax.ARTICLE_DEFAULTS),
  "8bit": {
    "mu_format": "int8",
    "nu_format": "uint8",
    "accumulator_format": "int8_sr",
  },
  "freezing": {"freeze_threshold": 1e-3, "freeze_warmup_steps": 2},
  "zclip_l2_decay": {"zclip": 2.0, "l2": 1e-3, "weight_decay": 1e-2},
}


def _params():
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {
    k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())
  }


def _grads(step):
  keys = jax.random.split(jax.random.key(100 + step), len(SHAPES))
  return {
    k: jax.random.normal(key, s) * (1.0 + 0.1 * step)
    for key, (k, s) in zip(keys, SHAPES.items())
  }


def _steps(tx, params, state, first, count):
  update = jax.jit(tx.update)
  out = []
  for t in range(first, first + count):
    updates, state = update(_grads(t), state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return params, state, out


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("saved_fused", [True, False])
def test_a_checkpoint_of_one_form_continues_in_the_other(
  name, saved_fused, tmp_path
):
  kwargs = SETTINGS[name]
  saver = grpo_optax.grpo(1e-2, fused=saved_fused, **kwargs)
  loader = grpo_optax.grpo(1e-2, fused=not saved_fused, **kwargs)
  params = _params()
  params, state, _ = _steps(saver, params, saver.init(params), 0, 3)
  # The two forms describe the same state.
  assert jax.tree.structure(state) == jax.tree.structure(loader.init(params))

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(
    tmp_path / "state",
    jax.tree.map(ocp.utils.to_shape_dtype_struct, loader.init(params)),
  )
  assert isinstance(restored, grpo_optax.GrpoState)

  _, _, want = _steps(saver, params, state, 3, 5)
  _, _, got = _steps(loader, params, restored, 3, 5)
  for t, (u_want, u_got) in enumerate(zip(want, got)):
    for k in SHAPES:
      np.testing.assert_allclose(
        np.asarray(u_got[k]),
        np.asarray(u_want[k]),
        rtol=1e-6,
        atol=1e-9,
        err_msg=f"{name}: update {t + 4}, leaf {k}",
      )


def test_the_fused_and_chain_forms_store_the_same_state_types():
  params = _params()
  for kwargs in SETTINGS.values():
    a = grpo_optax.grpo(fused=True, **kwargs).init(params)
    b = grpo_optax.grpo(fused=False, **kwargs).init(params)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert [type(f) for f in a] == [type(f) for f in b]
    # Nothing in the state is a jnp scalar the other form would not have.
    assert all(isinstance(x, jnp.ndarray) for x in jax.tree.leaves(a))
