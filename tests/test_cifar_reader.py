"""The CIFAR-10 reader on a small archive written in the real format."""

import io
import os
import pickle
import tarfile

import numpy as np
import pytest

from examples.resnet_cifar10 import input_pipeline as ip
from examples.resnet_cifar10 import main
from examples.resnet_cifar10 import train

_PER_BATCH = 3
_NUM_TEST = 2


def _batch(rng, n, label):
  data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
  labels = rng.integers(0, 10, size=n).tolist()
  return {
    b"batch_label": label.encode(),
    b"labels": labels,
    b"data": data,
    b"filenames": [f"img_{i}.png".encode() for i in range(n)],
  }


def _write_cifar(tmp_path):
  """Writes cifar-10-batches-py/ and cifar-10-python.tar.gz; returns batches."""
  rng = np.random.default_rng(0)
  names = [*ip.CIFAR10_TRAIN_BATCHES, ip.CIFAR10_TEST_BATCH]
  batches = {
    name: _batch(rng, _NUM_TEST if name == "test_batch" else _PER_BATCH, name)
    for name in names
  }
  folder = tmp_path / "extracted" / ip.CIFAR10_FOLDER
  folder.mkdir(parents=True)
  archive = tmp_path / "archive" / ip.CIFAR10_ARCHIVE
  archive.parent.mkdir()
  with tarfile.open(archive, "w:gz") as tar:
    for name, batch in batches.items():
      payload = pickle.dumps(batch, protocol=2)
      (folder / name).write_bytes(payload)
      info = tarfile.TarInfo(f"{ip.CIFAR10_FOLDER}/{name}")
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))
  return batches, folder, archive


def _expected(batches, names):
  data = np.concatenate([batches[n][b"data"] for n in names])
  labels = np.concatenate([batches[n][b"labels"] for n in names])
  # Row layout: 1024 red, 1024 green, 1024 blue values, each row-major 32x32.
  images = np.stack(
    [data[:, :1024], data[:, 1024:2048], data[:, 2048:]], axis=-1
  ).reshape(-1, 32, 32, 3)
  return images, labels.astype(np.int32)


@pytest.fixture(name="cifar")
def fixture_cifar(tmp_path):
  return _write_cifar(tmp_path)


@pytest.mark.parametrize(
  "where",
  ["archive_file", "archive_dir", "extracted_folder", "extracted_parent"],
)
def test_read_cifar10_matches_pickled_batches(cifar, where):
  batches, folder, archive = cifar
  path = {
    "archive_file": archive,
    "archive_dir": archive.parent,
    "extracted_folder": folder,
    "extracted_parent": folder.parent,
  }[where]
  x_tr, y_tr, x_te, y_te = ip.read_cifar10(str(path))
  want_x, want_y = _expected(batches, ip.CIFAR10_TRAIN_BATCHES)
  np.testing.assert_array_equal(x_tr, want_x)
  np.testing.assert_array_equal(y_tr, want_y)
  want_x, want_y = _expected(batches, [ip.CIFAR10_TEST_BATCH])
  np.testing.assert_array_equal(x_te, want_x)
  np.testing.assert_array_equal(y_te, want_y)
  assert x_tr.shape == (5 * _PER_BATCH, 32, 32, 3) and x_tr.dtype == np.uint8
  assert y_tr.dtype == np.int32


def test_pixel_layout(cifar):
  """Pixel (row r, col c, channel k) is byte k*1024 + r*32 + c of the row."""
  batches, folder, _ = cifar
  x_tr, _, _, _ = ip.read_cifar10(str(folder))
  row = batches["data_batch_1"][b"data"][0]
  for r, c, k in [(0, 0, 0), (0, 1, 0), (1, 0, 2), (31, 30, 1)]:
    assert x_tr[0, r, c, k] == row[k * 1024 + r * 32 + c]


def test_load_cifar10_normalises_and_truncates(cifar):
  batches, folder, _ = cifar
  ds = ip.load_cifar10(str(folder), max_train=7, max_test=1)
  assert ds.train_images.shape == (7, 32, 32, 3)
  assert ds.test_images.shape == (1, 32, 32, 3)
  assert ds.train_images.dtype == np.float32
  # Standardised per channel with the statistics of the 7 kept images.
  np.testing.assert_allclose(ds.train_images.mean(axis=(0, 1, 2)), 0, atol=1e-4)
  np.testing.assert_allclose(ds.train_images.std(axis=(0, 1, 2)), 1, rtol=1e-4)
  # The test image with the training statistics, computed here in float64.
  train, _ = _expected(batches, ip.CIFAR10_TRAIN_BATCHES)
  test, _ = _expected(batches, [ip.CIFAR10_TEST_BATCH])
  train = train[:7].astype(np.float64) / 255
  mean, std = train.mean(axis=(0, 1, 2)), train.std(axis=(0, 1, 2))
  np.testing.assert_allclose(
    ds.test_images[0], (test[0] / 255 - mean) / std, rtol=1e-4, atol=1e-5
  )


def test_missing_data_gives_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="--download"):
    ip.read_cifar10(str(tmp_path))


def test_missing_batch_is_reported(cifar):
  _, folder, _ = cifar
  os.remove(folder / "data_batch_3")
  with pytest.raises(FileNotFoundError, match="data_batch_3"):
    ip.read_cifar10(str(folder))


def test_bad_batch_shape_is_rejected(cifar):
  _, folder, _ = cifar
  bad = {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}
  (folder / "data_batch_2").write_bytes(pickle.dumps(bad))
  with pytest.raises(ValueError, match="3072"):
    ip.read_cifar10(str(folder))


def test_pickle_with_code_is_refused(cifar):
  _, folder, _ = cifar
  (folder / "test_batch").write_bytes(pickle.dumps({b"data": os.getcwd}))
  with pytest.raises(pickle.UnpicklingError, match="unexpected object"):
    ip.read_cifar10(str(folder))


def test_md5_helper(tmp_path):
  path = tmp_path / "f"
  path.write_bytes(b"abc")
  assert ip._md5(str(path)) == "900150983cd24fb0d6963f7d28e17f72"  # pylint: disable=protected-access


def test_example_flags_load_the_archive(cifar):
  _, _, archive = cifar
  args = main.parse_args(
    [
      "--dataset",
      "cifar10",
      "--data-dir",
      str(archive.parent),
      "--max-train-examples",
      "4",
    ]
  )
  ds = train.load_dataset(args)
  assert ds.name == "cifar10" and ds.image_shape == (32, 32, 3)
  assert len(ds.train_labels) == 4 and len(ds.test_labels) == _NUM_TEST
