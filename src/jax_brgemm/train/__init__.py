"""MLPerf-style training harness: ``python -m jax_brgemm.train BENCHMARK``.

The suite (``SUITE``) defines each benchmark as data (``Benchmark``, with its input
pipeline, loss and metric from ``task``); ``step`` holds the one train and eval step
every benchmark uses (with an optional data-parallel axis); ``run_benchmark`` runs a set
of runs of one with MLPerf semantics and logs (``runner``; the command line is ``cli``);
``compliance_config(benchmark)`` is the ruleset to pass to
``python -m mlperf_logging.compliance_checker --config``.
"""

from .cli import main
from .compliance import compliance_config
from .runner import run_benchmark
from .suite import SUITE, Benchmark

__all__ = ["SUITE", "Benchmark", "compliance_config", "main", "run_benchmark"]
