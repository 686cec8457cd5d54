"""Datasets stored as IDX files: locate, verify, download, load, batch, evict from cache.

Every file of a dataset comes from one directory:

- ``--data-dir DIR`` given: DIR must hold every file, nothing is looked up elsewhere
  or downloaded;
- otherwise the first of ``$JAX_BRGEMM_DATA`` and the dataset's system directory (a
  Debian package) that holds every file; if neither does, the missing files are
  downloaded from upstream into ``$JAX_BRGEMM_DATA`` (when set) or
  ``~/.cache/jax_brgemm/<dataset>``, and all files are read from there.

Checksums are SHA-256 of the *decompressed* IDX bytes. The Debian package ships
the same IDX contents as upstream but re-gzipped (different gzip headers), so a
checksum of the .gz files could not accept both; the payload checksum does, and
also accepts files a user has already gunzipped.
"""

import ctypes
import dataclasses
import gzip
import hashlib
import mmap
import os
import shutil
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import numpy as np

ENV_VAR = "JAX_BRGEMM_DATA"


class DataError(Exception):
    """A dataset file is missing, corrupt or cannot be downloaded (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class IdxFile:
    """One IDX file: its name without ``.gz``, payload checksum, shape and element type
    (a numpy dtype string as IDX stores it, e.g. ``uint8`` or big-endian ``>i4``)."""

    name: str
    sha256: str
    shape: tuple[int, ...]
    dtype: str = "uint8"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset made of IDX files, each verified by its checksum.

    What the files mean (which hold a split's inputs and labels, how they are
    preprocessed) is the benchmark's input pipeline (task.Pipeline), not the dataset's.

    Attributes:
      name: short name, also the cache sub-directory.
      files: role (e.g. ``train_images``) -> file.
      mirrors: base URLs tried in order for a download (file name + ``.gz`` appended).
      system_dir: where a system package installs the files.
      system_package: the package that does, named in error messages.
    """

    name: str
    files: Mapping[str, IdxFile]
    mirrors: Sequence[str]
    system_dir: Optional[str]
    system_package: Optional[str]


# Checksums computed from the Debian package dataset-fashion-mnist
# (0.0~git20200523.55506a9-1); its decompressed files have the MD5s published
# for the upstream raw files (torchvision's FashionMNIST raw checksums).
FASHION_MNIST = Dataset(
    name="fashion-mnist",
    files={
        "train_images": IdxFile(
            "train-images-idx3-ubyte",
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
            (60000, 28, 28)),
        "train_labels": IdxFile(
            "train-labels-idx1-ubyte",
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
            (60000,)),
        "test_images": IdxFile(
            "t10k-images-idx3-ubyte",
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
            (10000, 28, 28)),
        "test_labels": IdxFile(
            "t10k-labels-idx1-ubyte",
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
            (10000,)),
    },
    mirrors=(
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    ),
    system_dir="/usr/share/datasets/fashion-mnist",
    system_package="dataset-fashion-mnist",
)


# --------------------------------------------------------------------------- locate


def search_dirs(dataset: Dataset) -> list[Path]:
    """The directories searched when no --data-dir is given, in lookup order."""
    dirs = [os.environ.get(ENV_VAR) or None, dataset.system_dir]
    return [Path(d).expanduser() for d in dirs if d]


def download_dir(dataset: Dataset) -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return Path("~/.cache/jax_brgemm").expanduser() / dataset.name


def locate(dataset: Dataset, data_dir=None, download: bool = True) -> dict[str, Path]:
    """Finds (or downloads) every file of ``dataset``, all in one directory, and
    verifies their checksums.

    Returns a mapping from role (``train_images`` ...) to the verified path.
    Raises DataError naming the file and the fix when a file is missing or bad.
    """
    if data_dir is not None:
        directory = Path(data_dir).expanduser()
        if not directory.is_dir():
            raise DataError(f"{dataset.name}: --data-dir {directory} is not a directory. Fix: "
                            f"pass the directory that holds the files, or drop --data-dir "
                            f"to use {_lookup_description(dataset)}.")
        found = _find_all(dataset, directory)
        missing = [dataset.files[role].name for role, path in found.items() if path is None]
        if missing:
            raise DataError(f"{dataset.name}: --data-dir {directory} lacks {', '.join(missing)} "
                            f"(.gz or not); an explicit --data-dir must hold every file. Fix: "
                            f"put them there, or drop --data-dir to use "
                            f"{_lookup_description(dataset)}.")
    else:
        complete = (f for f in (_find_all(dataset, d) for d in search_dirs(dataset))
                    if None not in f.values())
        found = next(complete, None) or _download_missing(dataset, download)
    for role, path in found.items():
        verify(path, dataset.files[role], dataset)
    return found


def _download_missing(dataset: Dataset, download: bool) -> dict[str, Path]:
    """The download directory's files, after downloading those it lacks."""
    directory = download_dir(dataset)
    found = _find_all(dataset, directory)
    for role, path in found.items():
        if path is None:
            if not download:
                raise DataError(_missing_message(dataset, dataset.files[role]))
            found[role] = fetch_file(dataset, dataset.files[role], directory)
    return found


def _lookup_description(dataset) -> str:
    where = [f"${ENV_VAR}"] + ([dataset.system_dir] if dataset.system_dir else [])
    return " or ".join(where) + " or a download"


def _find_all(dataset: Dataset, directory: Path) -> dict[str, Optional[Path]]:
    return {role: _find(spec, [directory]) for role, spec in dataset.files.items()}


def _find(spec: IdxFile, dirs: Sequence[Path]) -> Optional[Path]:
    for d in dirs:
        for candidate in (d / (spec.name + ".gz"), d / spec.name):
            if candidate.is_file():
                return candidate
    return None


def _fix_hint(dataset: Dataset) -> str:
    hint = "pass --data-dir DIR with the files (or set $%s)" % ENV_VAR
    if dataset.system_package:
        hint = f"run `sudo apt-get install {dataset.system_package}`, or " + hint
    return hint


def _missing_message(dataset, spec):
    where = ", ".join(str(d) for d in [*search_dirs(dataset), download_dir(dataset)])
    return (f"{dataset.name}: file {spec.name}(.gz) not found in {where}. "
            f"Fix: {_fix_hint(dataset)}.")


# --------------------------------------------------------------------------- verify


def read_payload(path: Path) -> bytes:
    """The IDX bytes of ``path``, gunzipped when it ends in .gz."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def verify(path: Path, spec: IdxFile, dataset: Dataset) -> None:
    """Checks the SHA-256 of the file's IDX payload; raises DataError if wrong."""
    fix = ("delete it and run again to download a fresh copy"
           + (f", or `sudo apt-get install --reinstall {dataset.system_package}`"
              if dataset.system_package and dataset.system_dir
              and Path(path).parent == Path(dataset.system_dir) else ""))
    try:
        payload = read_payload(path)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: checksum verification failed, the file is corrupt or "
                        f"truncated ({e}). Fix: {fix}.") from e
    digest = hashlib.sha256(payload).hexdigest()
    if digest != spec.sha256:
        raise DataError(f"{path}: SHA-256 checksum mismatch (expected {spec.sha256}, "
                        f"got {digest}); the file is corrupt or not the {dataset.name} "
                        f"file {spec.name}. Fix: {fix}.")


# --------------------------------------------------------------------------- download


def fetch(url: str, dest: Path, timeout: float = 60.0) -> None:
    """Copies ``url`` to ``dest`` (a separate function so tests can replace it)."""
    with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as out:
        shutil.copyfileobj(response, out)


def fetch_file(dataset: Dataset, spec: IdxFile, dest_dir: Path) -> Path:
    """Downloads ``spec`` from the first mirror that serves a valid copy."""
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{dataset.name}: cannot create download directory {dest_dir} "
                        f"({e}). Fix: {_fix_hint(dataset)}.") from e
    dest = dest_dir / (spec.name + ".gz")
    errors = []
    for mirror in dataset.mirrors:
        url = mirror + spec.name + ".gz"
        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".download-", suffix=".gz")
        os.close(fd)
        try:
            fetch(url, Path(tmp))
            # Verified before it gets its real name, so a bad download is never
            # found by the next lookup.
            verify(Path(tmp), spec, dataset)
            os.replace(tmp, dest)
            return dest
        except (OSError, DataError) as e:
            errors.append(f"{url}: {e}")
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    searched_dirs = ", ".join(str(d) for d in [*search_dirs(dataset), dest_dir])
    raise DataError(f"{dataset.name}: file {spec.name}(.gz) is not in {searched_dirs} "
                    f"and could not be downloaded: " + "; ".join(errors)
                    + f". Fix: {_fix_hint(dataset)}.")


# --------------------------------------------------------------------------- load

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(payload: bytes, name: str = "IDX data") -> np.ndarray:
    """Decodes IDX bytes: 2 zero bytes, a dtype code, the rank, big-endian dims, data."""
    if len(payload) < 4 or payload[0] != 0 or payload[1] != 0 or payload[2] not in _IDX_DTYPES:
        raise DataError(f"{name}: not an IDX file (bad magic number)")
    dtype, rank = np.dtype(_IDX_DTYPES[payload[2]]), payload[3]
    header = 4 + 4 * rank
    if len(payload) < header:
        raise DataError(f"{name}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(payload, ">u4", rank, offset=4))
    if len(payload) - header != dtype.itemsize * int(np.prod(shape)):
        raise DataError(f"{name}: IDX size does not match its header shape {shape}")
    return np.frombuffer(payload, dtype, offset=header).reshape(shape)


def load(dataset: Dataset, paths: Mapping[str, Path]) -> dict[str, np.ndarray]:
    """Reads the (already verified) files into memory: role -> array."""
    arrays = {}
    for role, spec in dataset.files.items():
        array = parse_idx(read_payload(paths[role]), str(paths[role]))
        if array.shape != spec.shape or array.dtype != np.dtype(spec.dtype):
            raise DataError(f"{paths[role]}: {array.dtype} array of shape {array.shape}, "
                            f"expected {np.dtype(spec.dtype)} of shape {spec.shape}")
        arrays[role] = array
    return arrays


# Evictions tried before a file counts as not cleared, and the pause after the first failure
# (doubled each time). DONTNEED skips pages the kernel is busy with at that moment (a file
# just written may still be in writeback on some filesystems): CI saw 96 of 155 pages of a
# fresh file stay once, which a later attempt drops.
_EVICT_ATTEMPTS, _EVICT_PAUSE_S = 5, 0.02


def drop_page_cache(paths) -> dict:
    """Evicts the files from the OS page cache, so the timed run reads them from disk,
    and checks with mincore(2) that it worked.

    Uses fsync and posix_fadvise(DONTNEED) on each file, which need no privileges and leave
    other users' cached data alone, retried a few times while pages remain. Returns
    ``{"cleared": bool, "cached_pages": n, "pages": total}``: cleared only when no page of
    any file is left in the cache.
    """
    cached = total = 0
    try:
        for path in paths:
            for attempt in range(_EVICT_ATTEMPTS):
                if attempt:
                    time.sleep(_EVICT_PAUSE_S * 2 ** (attempt - 1))
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages (a file just written) cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                file_cached, file_pages = cached_pages(path)
                if file_cached == 0:
                    break
            cached, total = cached + file_cached, total + file_pages
    except (OSError, AttributeError):  # AttributeError: no posix_fadvise on this OS
        return {"cleared": False, "cached_pages": None, "pages": None}
    return {"cleared": cached == 0, "cached_pages": cached, "pages": total}


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_pages(path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file), from mincore(2)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        # Mapping a file reads nothing; mincore reports which of its pages are cached.
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(v & 1 for v in vector), pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


# statfs(2) f_type of file systems that keep files in RAM.
_IN_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def in_memory_filesystem(path) -> Optional[str]:
    """"tmpfs" or "ramfs" when ``path`` lives in RAM, else None (also where unknown)."""
    buffer = ctypes.create_string_buffer(512)  # struct statfs; f_type is its first field
    if _libc.statfs(os.fsencode(str(path)), buffer) != 0:
        return None
    return _IN_MEMORY_FILESYSTEMS.get(ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF)


# --------------------------------------------------------------------------- batch


class Batch(NamedTuple):
    """A fixed-size batch; ``weight`` is 0 for padding rows, 1 for real examples."""

    inputs: np.ndarray
    labels: np.ndarray
    weight: np.ndarray


def _batch(inputs, labels, index, batch_size, shard=(0, 1)) -> Batch:
    # The last batch is padded to the full size (allowed by the rules) so one
    # compiled step serves the whole epoch; padding rows have weight 0.
    # shard = (i, n): only rows [i * batch_size // n, (i + 1) * batch_size // n) of the
    # (padded) batch are gathered, the part process i of n reads and preprocesses.
    n = len(index)
    weight = np.zeros(batch_size, np.float32)
    weight[:n] = 1.0
    if n < batch_size:
        index = np.concatenate([index, np.zeros(batch_size - n, index.dtype)])
    i, count = shard
    if count > 1:
        rows = batch_size // count
        index, weight = index[i * rows:(i + 1) * rows], weight[i * rows:(i + 1) * rows]
    return Batch(inputs[index], labels[index], weight)


def _check_shard(batch_size, shard):
    i, count = shard
    if not 0 <= i < count or batch_size % count:
        raise ValueError(f"shard {shard} of a batch of {batch_size}: need 0 <= i < n and "
                         f"n dividing the batch size")


def train_batches(inputs, labels, batch_size: int, seed: int, epoch: int,
                  shard=(0, 1)) -> Iterator[Batch]:
    """One epoch in a random order drawn from (seed, epoch): every example once.

    With ``shard=(i, n)``, process i of n gets its rows of the same global batches, in
    the same order, as one process gets whole (data parallelism over n processes).
    """
    _check_shard(batch_size, shard)
    order = np.random.default_rng([seed, epoch]).permutation(len(inputs))
    for start in range(0, len(order), batch_size):
        yield _batch(inputs, labels, order[start:start + batch_size], batch_size, shard)


def eval_batches(inputs, labels, batch_size: int, shard=(0, 1)) -> Iterator[Batch]:
    """The whole evaluation set in its stored order (this process's rows with ``shard``)."""
    _check_shard(batch_size, shard)
    order = np.arange(len(inputs))
    for start in range(0, len(order), batch_size):
        yield _batch(inputs, labels, order[start:start + batch_size], batch_size, shard)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Writes a uint8 array as a (gzipped if path ends in .gz) IDX file; for tests and tools."""
    array = np.ascontiguousarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())
