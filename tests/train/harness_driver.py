"""The harness on a tiny benchmark ROOT (tiny_benchmark.py) in a process of its own, for
tests that signal, kill or scale out a run:

    python tests/train/harness_driver.py ROOT [harness arguments]

With ``--processes N`` the launcher starts N copies of this same command, so every worker
has the tiny suite too. $STEP_SLEEP (seconds, default 0) slows down each training batch,
so that a signal lands in the middle of an epoch; with $JB_TEST_PARAMS, each process saves
each run's final parameters to $JB_TEST_PARAMS.<process index>.npz.
"""

import os
import sys
from pathlib import Path

import tiny_benchmark  # next to this script, whose directory Python puts first on sys.path

from jax_brgemm.train import cli

if __name__ == "__main__":
    root = Path(sys.argv[1])
    suite = tiny_benchmark.tiny_suite(root, float(os.environ.get("STEP_SLEEP", "0")))
    prefix = os.environ.get("JB_TEST_PARAMS")
    sys.exit(cli.main(sys.argv[2:], worker_command=[sys.executable, __file__, sys.argv[1]],
                      suite=suite, on_run_end=tiny_benchmark.params_saver(prefix) if prefix
                      else None))
