"""jax_brgemm: batch-reduce GEMM kernels as differentiable XLA CPU custom calls."""

from jax_brgemm._native import isa
from jax_brgemm.ops.brgemm import brgemm

__all__ = ["brgemm", "isa"]
__version__ = "0.1.0"
