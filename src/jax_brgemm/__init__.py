"""jax_brgemm: batch-reduce GEMM kernels as differentiable XLA CPU custom calls."""

from jax_brgemm._native import isa
from jax_brgemm.ops.brgemm import brgemm
from jax_brgemm.ops.conv import conv2d
from jax_brgemm.ops.dense import dense
from jax_brgemm import nn

__all__ = ["brgemm", "conv2d", "dense", "isa", "nn"]
__version__ = "0.1.0"
