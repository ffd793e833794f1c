"""Image data: scikit-learn's bundled 8x8 digits, or CIFAR-10 from local files.

CIFAR-10 is read from the python-pickle release
(``cifar-10-python.tar.gz``), either the archive itself or its extracted
``cifar-10-batches-py/`` folder. It is downloaded only with ``download=True``.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import io
import os
import pickle
import tarfile
import tempfile
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
DATASETS = ("digits", "cifar10")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Normalised images (float32, NHWC) and int32 labels, split train/test."""

  name: str
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.train_images.shape[1:])


def _normalise(train: np.ndarray, test: np.ndarray):
  """Standardises each channel with the training set's mean and std."""
  mean = train.mean(axis=(0, 1, 2), keepdims=True)
  std = train.std(axis=(0, 1, 2), keepdims=True) + 1e-6
  return ((train - mean) / std).astype(np.float32), (
    (test - mean) / std
  ).astype(np.float32)


def _truncate(images, labels, limit):
  return (images, labels) if limit is None else (images[:limit], labels[:limit])


def load_digits(
  *,
  image_size: int = 8,
  test_fraction: float = 0.2,
  max_train: int | None = None,
  max_test: int | None = None,
) -> Dataset:
  """scikit-learn's 1,797 real 8x8 handwritten digits, split 80/20 (stratified).

  The split is fixed (seed 0), independent of the training seed, so all runs
  evaluate on the same 360 held-out images. ``image_size`` (a multiple of 8)
  enlarges the images by pixel repetition.
  """
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

  if image_size < 8 or image_size % 8:
    raise ValueError(
      f"digits image_size must be a multiple of 8, got {image_size}."
    )
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  factor = image_size // 8
  images = images.repeat(factor, axis=1).repeat(factor, axis=2)
  labels = digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
    images, labels, test_size=test_fraction, random_state=0, stratify=labels
  )
  x_tr, y_tr = _truncate(x_tr, y_tr, max_train)
  x_te, y_te = _truncate(x_te, y_te, max_test)
  x_tr, x_te = _normalise(x_tr, x_te)
  return Dataset("digits", x_tr, y_tr, x_te, y_te, num_classes=10)


# NumPy's array and scalar unpicklers, under whatever module path this NumPy
# version uses (numpy.core before 2.0, numpy._core since).
_NUMPY_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]


class _ArrayUnpickler(pickle.Unpickler):
  """Unpickles dicts, lists and NumPy arrays only (the CIFAR batch format).

  Plain ``pickle.load`` would run any code a tampered file names.
  """

  _ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
  }  # Python 3 writes bytes this way.

  def find_class(self, module, name):
    if (module, name) not in self._ALLOWED:
      raise pickle.UnpicklingError(
        f"unexpected object {module}.{name} in a CIFAR-10 batch file."
      )
    if name == "_reconstruct":
      return _NUMPY_RECONSTRUCT
    if name == "scalar":
      return _NUMPY_SCALAR
    if module == "_codecs":
      return codecs.encode
    return getattr(np, name)


def _parse_batch(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
  """Decodes one pickled batch into uint8 ``[N, 32, 32, 3]`` and int32 ``[N]``."""
  batch = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
  if (
    not isinstance(batch, dict)
    or b"data" not in batch
    or (b"labels" not in batch)
  ):
    raise ValueError(
      f"{name}: not a CIFAR-10 batch (needs b'data' and b'labels')."
    )
  images = np.asarray(batch[b"data"], dtype=np.uint8)
  labels = np.asarray(batch[b"labels"], dtype=np.int32)
  if images.ndim != 2 or images.shape[1] != 3072 or len(images) != len(labels):
    raise ValueError(
      f"{name}: expected data [N, 3072] and N labels, got "
      f"{images.shape} and {labels.shape}."
    )
  return images.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def _read_batches_from_tar(path: str) -> dict[str, bytes]:
  wanted = set(CIFAR10_TRAIN_BATCHES) | {CIFAR10_TEST_BATCH}
  found = {}
  with tarfile.open(path, "r:*") as tar:
    for member in tar:
      name = os.path.basename(member.name)
      if member.isfile() and name in wanted:
        found[name] = tar.extractfile(member).read()
  return found


def _read_batches_from_folder(folder: str) -> dict[str, bytes]:
  found = {}
  for name in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      with open(path, "rb") as f:
        found[name] = f.read()
  return found


def find_cifar10(data_dir: str) -> str:
  """The archive or batch folder under ``data_dir`` (or ``data_dir`` itself)."""
  candidates = [
    data_dir,
    os.path.join(data_dir, CIFAR10_FOLDER),
    os.path.join(data_dir, CIFAR10_ARCHIVE),
  ]
  for path in candidates:
    if os.path.isfile(path) and tarfile.is_tarfile(path):
      return path
    if os.path.isfile(os.path.join(path, CIFAR10_TEST_BATCH)):
      return path
  raise FileNotFoundError(
    f"no CIFAR-10 data in {data_dir!r}: expected {CIFAR10_ARCHIVE} or "
    f"{CIFAR10_FOLDER}/ (data_batch_1..5, test_batch). Pass --download to "
    f"fetch it from {CIFAR10_URL}."
  )


def read_cifar10(data_dir: str):
  """Reads CIFAR-10 from ``data_dir``, returning uint8 NHWC images and labels.

  ``data_dir`` may be the ``.tar.gz`` archive, the extracted
  ``cifar-10-batches-py`` folder, or a directory containing either.

  Returns:
    ``(train_images, train_labels, test_images, test_labels)``.
  """
  source = find_cifar10(data_dir)
  batches = (
    _read_batches_from_tar(source)
    if os.path.isfile(source)
    else _read_batches_from_folder(source)
  )
  missing = [
    n for n in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH) if n not in batches
  ]
  if missing:
    raise FileNotFoundError(f"{source}: missing CIFAR-10 batches {missing}.")
  train = [_parse_batch(batches[n], n) for n in CIFAR10_TRAIN_BATCHES]
  test_images, test_labels = _parse_batch(
    batches[CIFAR10_TEST_BATCH], CIFAR10_TEST_BATCH
  )
  return (
    np.concatenate([x for x, _ in train]),
    np.concatenate([y for _, y in train]),
    test_images,
    test_labels,
  )


def _md5(path: str) -> str:
  digest = hashlib.md5()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def download_cifar10(data_dir: str) -> str:
  """Downloads the CIFAR-10 archive into ``data_dir`` and checks its MD5."""
  os.makedirs(data_dir, exist_ok=True)
  path = os.path.join(data_dir, CIFAR10_ARCHIVE)
  if os.path.isfile(path) and _md5(path) == CIFAR10_MD5:
    return path
  fd, tmp = tempfile.mkstemp(dir=data_dir, suffix=".part")
  os.close(fd)
  try:
    print(f"Downloading {CIFAR10_URL} to {path} ...")
    urllib.request.urlretrieve(CIFAR10_URL, tmp)
    digest = _md5(tmp)
    if digest != CIFAR10_MD5:
      raise OSError(
        f"MD5 mismatch for {CIFAR10_URL}: got {digest}, expected {CIFAR10_MD5}."
      )
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def load_cifar10(
  data_dir: str,
  *,
  download: bool = False,
  max_train: int | None = None,
  max_test: int | None = None,
) -> Dataset:
  """CIFAR-10 (50,000 train / 10,000 test), standardised per channel."""
  if download:
    try:
      find_cifar10(data_dir)
    except FileNotFoundError:
      download_cifar10(data_dir)
  x_tr, y_tr, x_te, y_te = read_cifar10(data_dir)
  x_tr, y_tr = _truncate(x_tr, y_tr, max_train)
  x_te, y_te = _truncate(x_te, y_te, max_test)
  x_tr, x_te = _normalise(
    x_tr.astype(np.float32) / 255.0, x_te.astype(np.float32) / 255.0
  )
  return Dataset("cifar10", x_tr, y_tr, x_te, y_te, num_classes=10)


def random_crop_flip(key, images, *, pad: int = 4):
  """Random ``pad``-pixel translation (zero padding) and horizontal flip.

  A jittable function of ``key``, so augmentation follows the step's key.
  """
  batch, height, width, _ = images.shape
  k_shift, k_flip = jax.random.split(key)
  shifts = jax.random.randint(k_shift, (batch, 2), 0, 2 * pad + 1)
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  crop = lambda img, s: jax.lax.dynamic_slice(
    img, (s[0], s[1], 0), (height, width, img.shape[-1])
  )
  images = jax.vmap(crop)(padded, shifts)
  flip = jax.random.bernoulli(k_flip, 0.5, (batch, 1, 1, 1))
  return jnp.where(flip, images[:, :, ::-1], images)
