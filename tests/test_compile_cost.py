"""Compile cost of the update: flat in the number of leaves.

XLA compiles every distinct fused computation of a program separately, and
dedupes identical ones: a per-leaf constant fused into a leaf's kernels (a
slice of a shared vector at the leaf's index, say) makes every leaf's kernel
distinct, and compile time then grows by one kernel per leaf (about 12 ms
each on a CPU core). These tests count computations, not seconds: the count
of distinct fused computations of the compiled update + apply may not grow
with the number of leaves of a tree made of the same few shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from compile_options import USER_DEFAULT

import grpo_optax
from grpo_optax import hlo

# Per layer: four (32, 32) kernels and a (32, 128) one (masked: 1,024 and
# 4,096 entries) and four vectors (dense under the default min_size).
_LAYER = {
  "q": (32, 32),
  "k": (32, 32),
  "v": (32, 32),
  "o": (32, 32),
  "w1": (32, 128),
  "b1": (128,),
  "b2": (32,),
  "ln_scale": (32,),
  "ln_bias": (32,),
}

MODES = {
  "adam": lambda: optax.adam(1e-3),
  "dense": lambda: grpo_optax.grpo(1e-3, sparsify=None),
  "topk": lambda: grpo_optax.grpo(1e-3),
  "threshold": lambda: grpo_optax.grpo(1e-3, sparsify="threshold"),
  "article": lambda: grpo_optax.grpo(1e-3, **grpo_optax.ARTICLE_DEFAULTS),
  "topk_chain": lambda: grpo_optax.grpo(1e-3, fused=False),
  "int8": lambda: grpo_optax.grpo(1e-3, mu_format="int8", nu_format="uint8"),
  "freeze": lambda: grpo_optax.grpo(
    1e-3, freeze_threshold=0.3, freeze_warmup_steps=2
  ),
}


def _tree(n_layers: int, layer=None):
  layer = _LAYER if layer is None else layer
  return {
    f"layer_{i}": {k: jnp.full(s, 0.01, jnp.float32) for k, s in layer.items()}
    for i in range(n_layers)
  }


def _compiled(tx, n_layers: int, layer=None):
  """The donated update + apply of ``tx`` on :func:`_tree`, compiled with
  XLA's default emitters.
  """
  params = _tree(n_layers, layer)
  state = tx.init(params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, state, params)
    .compile(compiler_options=USER_DEFAULT)
  )


def _distinct(tx, n_layers: int) -> int:
  return hlo.fused_computations(_compiled(tx, n_layers))["distinct"]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_distinct_fused_computations_do_not_grow_with_the_leaves(mode):
  # 2 layers, not 1: a single layer fuses a few kernels differently (fewer
  # distinct computations), so the smallest tree to compare is 2 layers.
  small = _distinct(MODES[mode](), 2)  # 18 leaves
  large = _distinct(MODES[mode](), 4)  # 36 leaves
  # A kernel per leaf would add 18 at least; padding of the per-leaf
  # vectors' splits may add a kernel or two.
  assert large - small <= 3, (
    f"{mode}: {small} distinct fused computations with 18 leaves, {large} "
    "with 36: some kernel is compiled once per leaf"
  )


def _fusions(tx, n_layers: int) -> int:
  return hlo.fused_computations(_compiled(tx, n_layers))["fusions"]


def _in_one_device_process(test_name: str, *args) -> None:
  """Runs this file's ``test_name`` (with ``args``) in a child process that
  sees one device: with several devices and no known layout, leaves of one
  shape are not stacked (their shardings may differ).
  """
  import os
  import subprocess
  import sys

  flags = " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if "device_count" not in f
  )
  code = (
    "import sys; sys.path.insert(0, 'tests'); "
    f"import test_compile_cost as t; t.{test_name}(*{args!r})"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
    [sys.executable, "-c", code],
    cwd=root,
    env={**os.environ, "XLA_FLAGS": flags},
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_clipping_norm_adds_no_kernel_per_small_leaf():
  if jax.device_count() > 1:
    _in_one_device_process(
      "test_the_clipping_norm_adds_no_kernel_per_small_leaf"
    )
    return
  # Every fused computation counts here, equal or not: XLA:CPU compiles each
  # instance. Dense grpo() per leaf: the two moments and the apply, like
  # Adam; the norm of the small leaves (all of _LAYER's) is one reduction
  # per shape, not a square, a windowed sum and a sum per leaf (which was
  # 76 kernels per 2 layers against Adam's 54).
  adam = _fusions(optax.adam(1e-3), 4) - _fusions(optax.adam(1e-3), 2)
  dense = _fusions(MODES["dense"](), 4) - _fusions(MODES["dense"](), 2)
  assert dense <= adam + 2, (dense, adam)


# Kernels per leaf of a mechanism alone (chained with SGD): its state
# arrays and the update, plus what its per-leaf scalars need.
PER_LEAF = {
  # The score S and the Fisher EMA h (two state arrays), the update, S's sum
  # and the leaf's scale: 5. The diagnostics' weights computed sample by
  # sample in each leaf, and (S / bc) / denom written out for its readers,
  # made it 7.8.
  "importance": (grpo_optax.scale_by_importance, 5),
  # The two EMAs, the update and the leaf's sum: 4. The mean, floor and
  # scale computed leaf by leaf made it 6.4.
  "variance": (grpo_optax.scale_by_variance_lr, 4),
}


@pytest.mark.parametrize("name", sorted(PER_LEAF))
def test_per_leaf_scalars_add_no_kernel_per_leaf(name):
  if jax.device_count() > 1:
    _in_one_device_process("test_per_leaf_scalars_add_no_kernel_per_leaf", name)
    return
  make, per_leaf = PER_LEAF[name]
  tx = optax.chain(make(), optax.sgd(1e-3))
  added = _fusions(tx, 4) - _fusions(tx, 2)  # two layers of _LAYER's leaves
  # + a few per shape and group; jax 0.10 (the lowest supported) compiles 4
  # more of those than the newest does (variance: 85 against 81).
  budget = 2 * len(_LAYER) * per_leaf + 16
  assert added <= budget, (name, added, budget)


def _largest_fusion_inputs(tx, n_layers: int) -> int:
  """The most parameters of one fused computation of the compiled step."""
  text = _compiled(tx, n_layers).as_text()
  counts = [
    comp.count(" parameter(")
    for comp in re.split(r"\n(?=\S)", text)
    if comp.startswith("%fused_computation")
  ]
  return max(counts)


@pytest.mark.parametrize("mode", ["article", "dense", "topk"])
def test_no_kernel_takes_an_input_per_leaf(mode):
  # The articles' diagnostics (importance weights, variance rate) were one
  # sampled mean per leaf, summed over the leaves: XLA:CPU fused them into
  # one kernel with two inputs per leaf (772 on 384 leaves) whose fusion
  # pass time grew faster than quadratically (25 s of 87 s of compile at
  # 768 leaves). Samples of one shape are now reduced as one stack.
  small = _largest_fusion_inputs(MODES[mode](), 2)  # 18 leaves
  large = _largest_fusion_inputs(MODES[mode](), 4)  # 36 leaves
  assert large <= small + 4, (small, large)


# Leaves large enough to be sampled (a (64, 64) kernel holds 4,096 entries,
# of which the sampled threshold reads a random grid of 1,024).
_SAMPLED_LAYER = {
  "q": (64, 64),
  "k": (64, 64),
  "w1": (64, 256),
  "w2": (256, 64),
  "b1": (256,),
  "ln_scale": (64,),
}


def _instructions(tx, n_layers: int) -> int:
  """Every instruction of the compiled step on ``n_layers`` of
  ``_SAMPLED_LAYER``, fused computations included (XLA:CPU compiles each
  fusion instance, equal or not).
  """
  compiled = _compiled(tx, n_layers, _SAMPLED_LAYER)
  return sum(len(b) for b in hlo._computations(compiled.as_text()).values())


@pytest.mark.parametrize("mode", ["topk", "threshold"])
def test_masking_adds_few_instructions_per_leaf(mode):
  if jax.device_count() > 1:
    _in_one_device_process("_check_masking_instructions_per_leaf", mode)
    return
  _check_masking_instructions_per_leaf(mode)


def _check_masking_instructions_per_leaf(mode):
  # Instructions added by 8 more layers, against dense grpo(): the mask, the
  # accumulator and a top-k leaf's sample add about 65% (measured 1.64x
  # top-k, 1.71x threshold). The sampled threshold's random offsets were a
  # hash computed as scalars, which XLA fused into every sampled leaf's
  # kernel (57 instructions each instead of 8): top-k was 2.09x.
  dense = _instructions(MODES["dense"](), 12) - _instructions(
    MODES["dense"](), 4
  )
  masked = _instructions(MODES[mode](), 12) - _instructions(MODES[mode](), 4)
  assert masked <= 1.8 * dense, (mode, masked, dense, masked / dense)


# A fused computation whose root is an elementwise op on an array: a
# parameter-sized kernel of one leaf (not a reduction).
_ELEMENTWISE_ROOT = re.compile(
  r"\[[0-9,]+\]\S* (add|multiply|subtract|divide|select|maximum|minimum|sqrt)\("
)
_SCALAR_OP = re.compile(r"\s*(ROOT )?%\S+ = \w+\[\]\S* ([\w-]+)\(")


def _scalar_ops_in_leaf_kernels(tx, n_layers: int) -> int:
  """Scalar instructions (other than parameters and constants) inside the
  compiled step's elementwise kernels on ``n_layers`` of ``_SAMPLED_LAYER``.
  """
  compiled = _compiled(tx, n_layers, _SAMPLED_LAYER)
  count = 0
  for name, body in hlo._computations(compiled.as_text()).items():
    root = next(line for line in body if line.startswith("ROOT"))
    if not name.startswith("fused") or not _ELEMENTWISE_ROOT.search(root):
      continue
    for line in body:
      m = _SCALAR_OP.match(line)
      if m and m.group(2) not in ("parameter", "constant"):
        count += 1
  return count


@pytest.mark.parametrize("mode", ["dense", "topk", "threshold"])
def test_step_scalars_reach_the_leaf_kernels_as_buffers(mode):
  if jax.device_count() > 1:
    _in_one_device_process("_check_step_scalars", mode)
    return
  _check_step_scalars(mode)


def _check_step_scalars(mode):
  # A scalar of the step computed by a cheap op after the last expensive one
  # (the clip factor's min(1, c / norm), the mask's "threshold >= 0") was
  # copied by XLA into every leaf's kernels: 3 scalar ops per leaf (dense: 72
  # on 4 layers, 216 on 12; with their constants, 9% of the dense preset's
  # instructions on 384 leaves). They are now computed once, and each
  # kernel reads their buffers.
  small = _scalar_ops_in_leaf_kernels(MODES[mode](), 4)
  large = _scalar_ops_in_leaf_kernels(MODES[mode](), 12)
  assert large == small, (mode, small, large)


def test_copy_bytes_reads_each_copys_dtype_and_shape():
  """``hlo.copy_bytes`` (the step-time table's "copies >= 1 MB") reads the
  copy's own shape and dtype: an int8 moment's codes count (1 byte each), a
  small float32 array does not, and other instructions are not copies.
  """
  codes = "  %copy.2 = s8[1024,1024]{1,0} copy(%state_mu_codes.1)"
  assert hlo.copy_bytes(codes) == [1 << 20]
  assert hlo.copy_bytes(codes.replace("s8", "bf16")) == [2 << 20]
  assert hlo.copy_bytes("  %c = f32[8,2]{1,0} copy(%x)") == [64]
  assert hlo.copy_bytes("  %f = f32[1024]{0} fusion(%x), calls=%c") == []
  compiled = (
    jax.jit(lambda x: x + 1, donate_argnums=0)
    .lower(jnp.zeros((4,), jnp.int8))
    .compile()
  )
  assert hlo.copy_bytes(compiled) == []
