"""Differentiable custom-call ops: each kernel pass an XLA FFI call as a JAX primitive with
JVP, transpose and batching rules (``primitive.py``)."""
