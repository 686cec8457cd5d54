"""jax_brgemm: batch-reduce GEMM kernels as differentiable XLA CPU custom calls."""

from jax_brgemm._native import isa
from jax_brgemm.ops.brgemm import brgemm
from jax_brgemm.ops.dense import dense
from jax_brgemm.ops.lstm import lstm
from jax_brgemm import nn

__all__ = ["brgemm", "dense", "isa", "lstm", "nn"]
__version__ = "0.1.0"
