"""CIFAR-style ResNets in Flax NNX.

``depth`` 8, 20 or 32: the ResNets of He et al. (2016, section 4.2) for 32x32
images, three stages of ``(depth - 2) / 6`` basic blocks with 16/32/64
channels. ``depth`` 18: ResNet-18 (four stages of two basic blocks, 64 to 512
channels) with the usual CIFAR adaptation, a 3x3 stride-1 stem and no max-pool.

BatchNorm statistics live in ``nnx.BatchStat`` variables; train with
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` so the optimizer never sees them.

References:
  He, Zhang, Ren, Sun. Deep Residual Learning for Image Recognition. CVPR 2016.
  https://arxiv.org/abs/1512.03385
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# depth -> (channels per stage, blocks per stage)
_ARCHITECTURES = {
  8: ((16, 32, 64), (1, 1, 1)),
  20: ((16, 32, 64), (3, 3, 3)),
  32: ((16, 32, 64), (5, 5, 5)),
  18: ((64, 128, 256, 512), (2, 2, 2, 2)),
}
DEPTHS = tuple(_ARCHITECTURES)


def _conv(
  cin: int, cout: int, kernel: int, stride: int, rngs: nnx.Rngs
) -> nnx.Conv:
  return nnx.Conv(
    cin,
    cout,
    (kernel, kernel),
    strides=(stride, stride),
    padding="SAME",
    use_bias=False,
    kernel_init=nnx.initializers.he_normal(),
    rngs=rngs,
  )


def _batch_norm(channels: int, rngs: nnx.Rngs, *, zero_init: bool = False):
  scale_init = nnx.initializers.zeros if zero_init else nnx.initializers.ones
  return nnx.BatchNorm(channels, momentum=0.9, scale_init=scale_init, rngs=rngs)


class BasicBlock(nnx.Module):
  """Two 3x3 convolutions with a residual connection.

  The shortcut is the identity, or a strided 1x1 convolution + BatchNorm when
  the shape changes. The last BatchNorm's scale starts at zero, so each block
  starts as the identity (Goyal et al., 2017), which helps short runs.
  """

  def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
    self.conv1 = _conv(cin, cout, 3, stride, rngs)
    self.bn1 = _batch_norm(cout, rngs)
    self.conv2 = _conv(cout, cout, 3, 1, rngs)
    self.bn2 = _batch_norm(cout, rngs, zero_init=True)
    self.project = stride != 1 or cin != cout
    if self.project:
      self.shortcut_conv = _conv(cin, cout, 1, stride, rngs)
      self.shortcut_bn = _batch_norm(cout, rngs)

  def __call__(self, x, *, train: bool):
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = self.bn2(self.conv2(y), use_running_average=not train)
    if self.project:
      x = self.shortcut_bn(self.shortcut_conv(x), use_running_average=not train)
    return jax.nn.relu(x + y)


class ResNet(nnx.Module):
  """ResNet-{8,20,32} (CIFAR) or ResNet-18 for small images, NHWC input."""

  def __init__(
    self,
    depth: int = 20,
    num_classes: int = 10,
    in_channels: int = 3,
    *,
    rngs: nnx.Rngs,
  ):
    if depth not in _ARCHITECTURES:
      raise ValueError(f"ResNet depth must be one of {DEPTHS}, got {depth}.")
    channels, blocks = _ARCHITECTURES[depth]
    self.stem = _conv(in_channels, channels[0], 3, 1, rngs)
    self.stem_bn = _batch_norm(channels[0], rngs)
    layers = []
    cin = channels[0]
    for stage, (cout, num_blocks) in enumerate(zip(channels, blocks)):
      for i in range(num_blocks):
        stride = 2 if stage > 0 and i == 0 else 1
        layers.append(BasicBlock(cin, cout, stride, rngs=rngs))
        cin = cout
    self.blocks = nnx.List(layers)
    self.head = nnx.Linear(cin, num_classes, rngs=rngs)

  def __call__(self, x, *, train: bool):
    """Returns float32 logits ``[B, num_classes]`` for images ``[B, H, W, C]``."""
    x = jax.nn.relu(self.stem_bn(self.stem(x), use_running_average=not train))
    for block in self.blocks:
      x = block(x, train=train)
    return self.head(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)
