"""Dataset files: IDX parsing, lookup order, SHA-256 verification, download, batching."""

import dataclasses
import gzip
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from jax_brgemm.train import cli, data, optim


def _idx_bytes(array):
    array = np.asarray(array, np.uint8)
    return bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">u4").tobytes() + array.tobytes()


def _make_dataset(tmp_path, n_train=40, n_test=20, system_dir=None, mirrors=()):
    """Writes four small gzipped IDX files to tmp_path/src; returns their Dataset spec."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": rng.integers(0, 10, n_train),
        "test_images": rng.integers(0, 256, (n_test, 28, 28)),
        "test_labels": rng.integers(0, 10, n_test),
    }
    names = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
    src = tmp_path / "src"
    src.mkdir()
    files = {}
    for role, array in arrays.items():
        payload = _idx_bytes(array)
        (src / (names[role] + ".gz")).write_bytes(gzip.compress(payload))
        files[role] = data.IdxFile(names[role], hashlib.sha256(payload).hexdigest(), array.shape)
    dataset = dataclasses.replace(data.FASHION_MNIST, name="tiny", files=files,
                                  system_dir=system_dir, system_package=None, mirrors=mirrors)
    return dataset, src, arrays


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the download cache lives under ~


def test_parse_idx_roundtrip(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    for name in ("a.gz", "a"):
        data.write_idx(tmp_path / name, array)
        np.testing.assert_array_equal(data.parse_idx(data.read_payload(tmp_path / name)), array)


@pytest.mark.parametrize("payload, message", [
    (b"\x01\x00\x08\x01" + b"\x00" * 8, "bad magic"),
    (b"\x00\x00\x08\x02\x00\x00\x00\x02", "truncated IDX header"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "does not match its header"),
])
def test_parse_idx_rejects_bad_data(payload, message):
    with pytest.raises(data.DataError, match=message):
        data.parse_idx(payload)


def test_lookup_order_data_dir_then_env_then_system(tmp_path, monkeypatch):
    dataset, src, _ = _make_dataset(tmp_path)
    dirs = {}
    for name in ("cli", "env", "system"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
    # The same files in every place; which one is used shows the lookup order.
    for d in dirs.values():
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
    dataset = dataclasses.replace(dataset, system_dir=str(dirs["system"]))
    monkeypatch.setenv(data.ENV_VAR, str(dirs["env"]))
    assert {p.parent for p in data.locate(dataset, dirs["cli"]).values()} == {dirs["cli"]}
    assert {p.parent for p in data.locate(dataset).values()} == {dirs["env"]}
    monkeypatch.delenv(data.ENV_VAR)
    assert {p.parent for p in data.locate(dataset).values()} == {dirs["system"]}


def test_uncompressed_files_are_accepted(tmp_path):
    dataset, src, arrays = _make_dataset(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in src.iterdir():
        (plain / f.stem).write_bytes(gzip.decompress(f.read_bytes()))
    paths = data.locate(dataset, plain, download=False)
    loaded = data.load(dataset, paths)
    np.testing.assert_array_equal(loaded["train_images"], arrays["train_images"])
    assert loaded["train_images"].dtype == np.uint8


def test_corrupt_file_is_refused_with_its_name_and_fix(tmp_path):
    dataset, src, _ = _make_dataset(tmp_path)
    path = src / "t10k-labels-idx1-ubyte.gz"
    payload = bytearray(gzip.decompress(path.read_bytes()))
    payload[-1] ^= 0xFF  # one changed label: still valid IDX, wrong content
    path.write_bytes(gzip.compress(bytes(payload)))
    with pytest.raises(data.DataError) as e:
        data.locate(dataset, src, download=False)
    assert str(path) in str(e.value) and "checksum mismatch" in str(e.value)
    assert "Fix:" in str(e.value)


def test_truncated_gzip_is_refused(tmp_path):
    dataset, src, _ = _make_dataset(tmp_path)
    path = src / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(data.DataError, match="corrupt or truncated"):
        data.locate(dataset, src, download=False)


def test_missing_file_without_download_names_file_and_fix(tmp_path):
    dataset, src, _ = _make_dataset(tmp_path)
    (src / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(data.DataError, match="--data-dir .* lacks t10k-images-idx3-ubyte"):
        data.locate(dataset, src)
    with pytest.raises(data.DataError, match="train-images-idx3-ubyte.*not found.*--data-dir"):
        data.locate(dataset, download=False)  # nothing in the cache, no download


def test_download_from_mirror_into_env_dir(tmp_path, monkeypatch):
    dataset, src, arrays = _make_dataset(tmp_path)
    dead, good = tmp_path / "dead", src
    dataset = dataclasses.replace(dataset, mirrors=(dead.as_uri() + "/", good.as_uri() + "/"))
    target = tmp_path / "data"
    monkeypatch.setenv(data.ENV_VAR, str(target))
    paths = data.locate(dataset)  # nothing there yet: fetched from the 2nd mirror
    assert {p.parent for p in paths.values()} == {target}
    loaded = data.load(dataset, paths)
    np.testing.assert_array_equal(loaded["train_labels"], arrays["train_labels"])
    assert sorted(os.listdir(target)) == sorted(os.listdir(src))  # no temporary files left


def test_download_goes_to_cache_without_data_dir(tmp_path):
    dataset, src, _ = _make_dataset(tmp_path, mirrors=())
    dataset = dataclasses.replace(dataset, mirrors=(src.as_uri() + "/",))
    paths = data.locate(dataset)
    assert {p.parent for p in paths.values()} == {tmp_path / "home/.cache/jax_brgemm/tiny"}


def test_explicit_data_dir_must_hold_every_file(tmp_path, monkeypatch):
    """--data-dir /nonexistent, or one lacking a file, never falls back."""
    dataset, src, _ = _make_dataset(tmp_path, system_dir=None)
    complete = tmp_path / "complete"
    complete.mkdir()
    for f in src.iterdir():
        (complete / f.name).write_bytes(f.read_bytes())
    dataset = dataclasses.replace(dataset, system_dir=str(complete))  # would have them all
    with pytest.raises(data.DataError, match="--data-dir /nonexistent is not a directory"):
        data.locate(dataset, "/nonexistent")
    (src / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(data.DataError, match="lacks train-labels-idx1-ubyte"):
        data.locate(dataset, src)


def test_files_come_from_one_directory(tmp_path, monkeypatch):
    """A directory lacking a file is skipped as a whole, not mixed with another one."""
    dataset, src, _ = _make_dataset(tmp_path)
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in list(src.iterdir())[:3]:
        (partial / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv(data.ENV_VAR, str(partial))
    dataset = dataclasses.replace(dataset, system_dir=str(src), mirrors=(src.as_uri() + "/",))
    assert {p.parent for p in data.locate(dataset).values()} == {src}  # the complete one
    dataset = dataclasses.replace(dataset, system_dir=None)
    # No complete directory: the download directory ($JAX_BRGEMM_DATA) is completed.
    assert {p.parent for p in data.locate(dataset).values()} == {partial}


def test_corrupt_download_is_rejected_and_not_kept(tmp_path, monkeypatch):
    dataset, src, _ = _make_dataset(tmp_path)
    dataset = dataclasses.replace(dataset, mirrors=("https://example.invalid/fmnist/",))
    urls = []

    def fake_fetch(url, dest, timeout=60.0):  # serves garbage instead of the data
        urls.append(url)
        Path(dest).write_bytes(gzip.compress(b"not the file"))

    monkeypatch.setattr(data, "fetch", fake_fetch)
    target = tmp_path / "data"
    monkeypatch.setenv(data.ENV_VAR, str(target))
    with pytest.raises(data.DataError, match="could not be downloaded.*checksum"):
        data.locate(dataset)
    assert urls == ["https://example.invalid/fmnist/train-images-idx3-ubyte.gz"]
    assert os.listdir(target) == []


def test_fashion_mnist_upstream_urls():
    urls = [m + f.name + ".gz" for m in data.FASHION_MNIST.mirrors
            for f in data.FASHION_MNIST.files.values()]
    assert "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/" \
           "fashion/train-images-idx3-ubyte.gz" in urls
    assert "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/" \
           "t10k-labels-idx1-ubyte.gz" in urls


@pytest.mark.skipif(not Path(data.FASHION_MNIST.system_dir).is_dir(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_debian_fashion_mnist_matches_checksums():
    paths = data.locate(data.FASHION_MNIST, download=False)
    assert {p.parent for p in paths.values()} == {Path(data.FASHION_MNIST.system_dir)}


@pytest.mark.skipif(not Path(data.FASHION_MNIST.system_dir).is_dir(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_cli_refuses_truncated_file_before_training(tmp_path, capsys):
    bad = tmp_path / "data"
    bad.mkdir()
    for f in Path(data.FASHION_MNIST.system_dir).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    payload = gzip.compress(b"\x00\x00\x08\x03" + b"\x00" * 5000)
    (bad / "train-images-idx3-ubyte.gz").write_bytes(payload[: len(payload) // 2])
    log_dir = tmp_path / "logs"
    code = cli.main(["mlp", "--impl", "xla", "--data-dir", str(bad), "--log-dir", str(log_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert "train-images-idx3-ubyte.gz" in err and "checksum" in err
    assert not log_dir.exists()  # nothing ran, no log was written


def test_train_batches_cover_every_example_once_per_epoch():
    n, batch = 103, 16
    images = np.arange(n, dtype=np.uint8).reshape(n, 1)
    labels = np.arange(n, dtype=np.int32)
    epochs = []
    for epoch in (1, 2):
        batches = list(data.train_batches(images, labels, batch, seed=7, epoch=epoch))
        assert len(batches) == optim.steps_per_epoch(n, batch) == 7
        assert all(b.inputs.shape == (batch, 1) and b.weight.shape == (batch,) for b in batches)
        seen = np.concatenate([b.labels[b.weight == 1] for b in batches])
        assert sorted(seen) == list(range(n))
        assert batches[-1].weight.sum() == n - 6 * batch  # padded, padding weighs 0
        epochs.append(seen)
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    again = np.concatenate([b.labels[b.weight == 1]
                            for b in data.train_batches(images, labels, batch, 7, 1)])
    np.testing.assert_array_equal(again, epochs[0])  # reproducible from (seed, epoch)


def test_eval_batches_keep_order():
    labels = np.arange(10, dtype=np.int32)
    batches = list(data.eval_batches(labels[:, None], labels, 4))
    np.testing.assert_array_equal(
        np.concatenate([b.labels[b.weight == 1] for b in batches]), labels)


def test_drop_page_cache_is_verified_with_mincore(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 40960)  # just written: dirty pages in the cache
    assert data.cached_pages(path) == (10, 10)
    assert data.drop_page_cache([path]) == {"cleared": True, "cached_pages": 0, "pages": 10}
    path.read_bytes()
    assert data.cached_pages(path)[0] == 10  # read back in
    assert data.drop_page_cache([tmp_path / "missing"])["cleared"] is False


def test_drop_page_cache_retries_pages_the_kernel_kept(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 40960)
    real, checks = data.cached_pages, []

    def kept_twice(p):  # the first two evictions leave pages behind
        checks.append(p)
        cached, pages = real(p)
        return (7 if len(checks) <= 2 else cached), pages

    monkeypatch.setattr(data, "cached_pages", kept_twice)
    monkeypatch.setattr(data, "_EVICT_PAUSE_S", 0.0)
    assert data.drop_page_cache([path]) == {"cleared": True, "cached_pages": 0, "pages": 10}
    assert len(checks) == 3
    monkeypatch.setattr(data, "cached_pages", lambda p: (4, 10))  # never leaves: give up
    assert data.drop_page_cache([path]) == {"cleared": False, "cached_pages": 4, "pages": 10}


@pytest.mark.skipif(data.in_memory_filesystem("/dev/shm") != "tmpfs", reason="no tmpfs /dev/shm")
def test_data_in_ram_is_detected_and_not_reported_cleared(tmp_path):
    assert data.in_memory_filesystem(tmp_path) is None
    path = Path("/dev/shm") / f"jax_brgemm_test_{os.getpid()}"
    try:
        path.write_bytes(b"x" * 8192)
        assert data.in_memory_filesystem(path) == "tmpfs"
        assert data.drop_page_cache([path])["cleared"] is False  # RAM is the storage
    finally:
        path.unlink()
