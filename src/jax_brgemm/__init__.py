"""jax_brgemm: batch-reduce GEMM kernels as differentiable XLA CPU custom calls."""

from jax_brgemm._native import export_safety_checks, isa
from jax_brgemm.ops.attention import dot_product_attention
from jax_brgemm.ops.brgemm import brgemm
from jax_brgemm.ops.conv import conv2d
from jax_brgemm.ops.conv3d import conv3d
from jax_brgemm.ops.dense import dense
from jax_brgemm.ops.lstm import lstm
from jax_brgemm.memory import reuse_freed_memory
from jax_brgemm.peak import peak_gflops
from jax_brgemm import nn
from jax_brgemm import nnx
from jax_brgemm import optim
from jax_brgemm.accelerate import accelerate

__all__ = ["accelerate", "brgemm", "conv2d", "conv3d", "dense", "dot_product_attention", "export_safety_checks", "isa",
           "lstm", "nn", "nnx", "optim", "peak_gflops", "reuse_freed_memory"]
__version__ = "0.1.0"
