"""flax's own source tree (its tests and examples), taken at test time from flax's source
distribution on the package registry, for the installed flax version, and never copied into
this repository.

The unpacked tree is cached under ``$JAX_BRGEMM_FLAX_SDIST_CACHE`` (default
``~/.cache/jax_brgemm/flax-sdist``); a test that needs it is skipped, with the reason, only
when the registry cannot be reached.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("JAX_BRGEMM_FLAX_SDIST_CACHE",
                            Path.home() / ".cache" / "jax_brgemm" / "flax-sdist"))

# What pip prints when it cannot reach the index, or reaches none that offers flax's sources
# (without retries an unreachable index only shows as no versions at all).
_OFFLINE_MARKERS = ("(from versions: none)", "NewConnectionError", "ConnectionError", "Max retries exceeded",
                    "Temporary failure in name resolution", "Network is unreachable",
                    "Name or service not known", "ConnectTimeout", "ReadTimeout", "timed out",
                    "ProxyError", "SSLError")


def flax_version() -> str:
    return importlib.metadata.version("flax")


def flax_source_tree() -> Path:
    """The unpacked ``flax-<version>`` source tree of the installed flax, downloaded once."""
    version = flax_version()
    root = CACHE / f"flax-{version}"
    if (root / "tests").is_dir():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", f"flax=={version}", "-d", tmp]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"the package registry did not answer: {' '.join(cmd)} timed out")
        log = run.stdout + run.stderr
        archives = sorted(Path(tmp).glob(f"flax-{version}.tar.gz"))
        if run.returncode != 0 or not archives:
            if any(marker in log for marker in _OFFLINE_MARKERS):
                pytest.skip(f"the package registry is unreachable or offers no flax=={version} "
                            f"source distribution ({' '.join(cmd)}):\n{log[-2000:]}")
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {run.returncode}):\n{log[-4000:]}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(archives[0]) as tar:
            tar.extractall(unpacked, filter="data")
        try:  # another process may have unpacked it meanwhile: keep the first
            os.replace(unpacked / f"flax-{version}", root)
        except OSError:
            if not (root / "tests").is_dir():
                raise
        shutil.rmtree(unpacked, ignore_errors=True)
    return root
