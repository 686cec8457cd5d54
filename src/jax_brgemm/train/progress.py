"""Terminal progress: a tqdm bar per epoch on a terminal, one line per epoch always.

Writes only to stdout/stderr; MLPerf logs go through their own file-only logger.
"""

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, num_runs: int, label: str, stream=None):
        self.num_runs = num_runs
        self.label = label
        self.stream = stream or sys.stdout
        # A live bar only on an interactive terminal; CI logs get the epoch lines.
        self.bars = sys.stderr.isatty()
        self.bar = None

    def _print(self, text):
        tqdm.write(text, file=self.stream)

    def start_run(self, index, seed, max_epochs, steps_per_epoch):
        self.run, self.steps = index, steps_per_epoch
        self._print(f"{self.label} run {index + 1}/{self.num_runs} (seed {seed}), "
                    f"at most {max_epochs} epochs")
        self._new_bar(1)

    def _new_bar(self, epoch):
        if self.bars:
            self.bar = tqdm(total=self.steps, desc=f"  epoch {epoch}", leave=False,
                            unit="step", file=sys.stderr)

    def step(self):
        if self.bar:
            self.bar.update()

    def epoch_done(self, epoch, loss, accuracy, throughput, data_fraction, elapsed):
        if self.bar:
            self.bar.close()
        self._print(f"  epoch {epoch:3d}  loss {loss:.4f}  accuracy {accuracy:.4f}  "
                    f"{throughput:8.0f} img/s  data {100 * data_fraction:4.1f}%  "
                    f"{elapsed:7.1f} s")
        self._new_bar(epoch + 1)

    def end_run(self, status, seconds):
        if self.bar:
            self.bar.close()
            self.bar = None
        self._print(f"  run_stop: {status} after {seconds:.1f} s")
