"""The harness on the checkpoint tests' tiny benchmark, in a process of its own (so that
a test can kill it): ``python tests/train_ckpt_driver.py ROOT [harness arguments]``.

ROOT holds the tiny data and rules (written by tests/test_train_checkpoint.py);
$STEP_SLEEP (seconds, default 0) slows each training batch down, so that a signal
lands in the middle of an epoch.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_train_checkpoint import register  # noqa: E402

from jax_brgemm.train import cli  # noqa: E402

if __name__ == "__main__":
    root = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as scratch:
        register(root, Path(scratch), float(os.environ.get("STEP_SLEEP", "0")))
        sys.exit(cli.main(sys.argv[2:]))
