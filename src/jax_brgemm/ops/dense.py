"""jb.dense: a fully-connected layer, ``y = activation(x @ kernel + bias)``, on the BRGEMM
kernels, differentiable to any order in both modes.

It runs as the fully-connected passes of ``ops/fc_passes.py``, each a primitive: one call
for the forward (bias and activation fused); its tangent is the activation's derivative
times ``x @ dkernel + dbias`` and ``dx @ kernel``, two more forward calls; and reverse mode,
the transpose of that tangent, is the activation's gradient ``dz`` once, then backward by
data and the weight update as separate calls, none for a ``dx`` nobody needs (the first
layer of a network): a third of the backward's work.

``attend`` (``x @ embedding.T``, a tied embedding's logits) is the backward-by-data pass
alone, on the table as it is stored.

Two pieces of that backward are public here for a caller that applies its optimizer
itself: ``act_grad`` (``dz`` from the layer's output), ``sgd_update`` and ``adamw_update``
(the weight update fused with an optimizer step, the gradients never formed;
``jax_brgemm.optim`` builds training steps of them).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, fc_passes

__all__ = ["act_grad", "adamw_update", "attend", "dense", "sgd_update"]


@emulation.exact_on_infinity("x", "kernel")
def dense(x, kernel, bias=None, *, activation=None, dtype=None, precision=None):
    """Fully-connected layer: ``activation(x @ kernel + bias)`` on the BRGEMM kernels.

    Args:
      x: ``(..., C)`` float32 or bfloat16. Leading dims are folded into the mini-batch; a
        leading dim of size 0 (an empty batch) gives an empty result.
      kernel: ``(C, K)`` float32 or bfloat16 (Flax's ``Dense`` kernel layout).
      bias: optional ``(K,)`` float32 or bfloat16.
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation, like
        ``flax.linen.gelu``), ``"sigmoid"`` or ``"tanh"``; fused into the kernel.
      dtype: the computation dtype, float32 or bfloat16. ``None`` promotes the arguments'
        dtypes like ``flax.linen.dtypes.promote_dtype``. ``x`` and ``kernel`` are used in
        this dtype (the kernel is cast while it is re-blocked, inside the call);
        accumulation, bias and activation are always float32.
      precision: the accuracy asked of the products, as ``lax.dot_general`` takes it (a
        ``lax.Precision``, a pair, a ``lax.DotAlgorithmPreset`` or their names; None follows
        ``jax.default_matmul_precision``); met by exact float32 products, or where
        ``jax_brgemm.precision`` emulates them (AMX) by bfloat16 ones in every pass.
        An algorithm outside its table is a ValueError.

    Returns:
      ``(..., K)`` in ``dtype``. Gradients come back in each argument's own dtype; with a
      float32 kernel and bfloat16 compute, the kernel gradient is accumulated and returned
      in float32 without a bfloat16 rounding in between.

    Sizes of 0 (no rows, C = 0 or K = 0) compute what ``x @ kernel + bias`` computes, in
    XLA: an empty result, or for C = 0 the activation of the bias. So does float64 (NumPy's
    default is float32 here, as JAX canonicalizes it, unless ``jax_enable_x64`` is on).
    """
    op = "jb.dense"
    x = check.array(x, "x", op, check.OP_DTYPES)
    kernel = check.array(kernel, "kernel", op, check.OP_DTYPES)
    if bias is not None:
        bias = check.array(bias, "bias", op, check.OP_DTYPES)
    act = check.activation(activation, op)
    computed = _precision.computed(_precision.accuracy(precision, op), op)
    check.rank(x, "x", op, "(..., C)", at_least=1)
    check.rank(kernel, "kernel", op, "(C, K)", exactly=2)
    c, k = kernel.shape
    if x.shape[-1] != c:
        raise ValueError(f"{op}: x {x.shape} has {x.shape[-1]} features but kernel "
                         f"{kernel.shape} expects C = {c}")
    if bias is not None:
        check.shape(bias, "bias", op, (k,), "(K,)")
    dtype = check.compute_dtype(op, dtype, x, kernel, bias, dtypes=check.OP_DTYPES)

    lead = x.shape[:-1]
    if x.size == 0 or kernel.size == 0 or dtype not in check.KERNEL_DTYPES:
        return _dense_xla(x, kernel, bias, activation, dtype)
    # bfloat16 products summed in float32, split inside the passes (precision.py)
    products = _precision.PRODUCTS[computed] if dtype == jnp.float32 else 0
    x2 = x.astype(dtype).reshape((-1, c))
    kernel_arg, bias_arg = kernel, bias
    kernel, bias = check.kernel_operand(kernel, dtype), check.kernel_operand(bias, jnp.float32)
    y, _ = fc_passes.forward(x2, kernel, bias, act, products)
    if _observers and not products:  # a fused optimizer step computes exact products
        y = _observers[-1](x2, kernel_arg, bias_arg, act, y)
    return y.reshape(lead + (k,))


@emulation.exact_on_infinity("x", "embedding")
def attend(x, embedding, *, dtype=None, precision=None):
    """``x @ embedding.T`` on the BRGEMM kernels: a tied embedding's logits, as
    ``flax.linen.Embed.attend`` computes them.

    The embedding table is read as it is stored, ``(V, C)``: the product is the
    fully-connected layer's backward-by-data pass, whose transposes are its forward (the
    gradient of ``x``) and its weight update (the table's), so neither direction makes a
    transposed copy of the table.

    Args:
      x: ``(..., C)`` float32 or bfloat16.
      embedding: ``(V, C)`` float32 or bfloat16.
      dtype, precision: as in ``dense``.

    Returns:
      ``(..., V)`` in ``dtype``; differentiable in both arguments to any order.
    """
    op = "jb.attend"
    x = check.array(x, "x", op, check.OP_DTYPES)
    embedding = check.array(embedding, "embedding", op, check.OP_DTYPES)
    computed = _precision.computed(_precision.accuracy(precision, op), "jb.dense")
    check.rank(x, "x", op, "(..., C)", at_least=1)
    check.rank(embedding, "embedding", op, "(V, C)", exactly=2)
    v, c = embedding.shape
    if x.shape[-1] != c:
        raise ValueError(f"{op}: x {x.shape} has {x.shape[-1]} features but embedding {embedding.shape} "
                         f"has C = {c}")
    dtype = check.compute_dtype(op, dtype, x, embedding, None, dtypes=check.OP_DTYPES)
    lead = x.shape[:-1]
    if x.size == 0 or embedding.size == 0 or dtype not in check.KERNEL_DTYPES:
        return _dense_xla(x, embedding.T, None, None, dtype)
    products = _precision.PRODUCTS[computed] if dtype == jnp.float32 else 0
    y = fc_passes.backward_data(x.astype(dtype).reshape((-1, c)), check.kernel_operand(embedding, dtype), products)
    return y.reshape(lead + (v,))


# Functions (x, kernel, bias, act, y) -> y called on every kernel-path dense call traced
# inside ``observe``, innermost last; jax_brgemm.optim uses them to find the layers whose
# optimizer step it can fuse (and to add its zero taps to their outputs).
_observers = []


@contextlib.contextmanager
def observe(fn):
    """Within the context, every dense call on the kernels passes its 2-D input, its kernel
    and bias (the objects given to ``dense``), its activation code and its 2-D output to
    ``fn``, and returns what ``fn`` returns in place of that output (same shape and dtype)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.pop()


def _dense_xla(x, kernel, bias, activation, dtype):
    """What the kernels compute, in XLA: for sizes the kernels do not take (0) and for
    float64."""
    acc = jnp.promote_types(dtype, jnp.float32)
    y = jnp.matmul(x.astype(dtype), kernel.astype(dtype), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return _activations.apply(activation, y).astype(dtype)


def act_grad(dy, y, activation):
    """``dy * activation'(.)`` from the layer's output ``y`` (the activations whose derivative
    is a function of the output: None, relu, sigmoid, tanh)."""
    act = check.activation(activation, "act_grad")
    if act == fc_passes.GELU:
        raise ValueError("act_grad: gelu's derivative is not a function of its output")
    return dy if act == fc_passes.NONE else fc_passes.activation_grad(dy, y, act)


def sgd_update(x, dz, kernel, kernel_trace, bias, bias_trace, lr, *, momentum, nesterov,
               weight_decay, bias_weight_decay=0.0, after=None):
    """One step of optax's ``chain(add_decayed_weights(weight_decay, <kernels>),
    sgd(lr, momentum, nesterov))`` for a dense layer whose gradients are ``x.T @ dz`` and
    ``sum(dz, 0)``, without forming them: the weight update computes each block of the
    kernel's gradient and applies it while it is in cache.

    ``x`` (N, C) and ``dz`` (N, K) in the layer's computation dtype (float32 or bfloat16);
    the parameters ``kernel`` (C, K), ``bias`` (K,) or None and their momenta (optax's
    ``TraceState.trace`` leaves) float32; ``lr`` the step's learning rate (a scalar).
    Returns the new ``(kernel, kernel_trace, bias, bias_trace)`` (bias ones None without a
    bias); the four buffers are updated in place when the caller donates them. Not
    differentiable. ``weight_decay`` applies to the kernel, ``bias_weight_decay`` to the bias.

    ``after``: an array the update waits for and does not read. The kernel is rewritten in
    place, so XLA copies it first unless every other reader of it is known to come before;
    pass the result of the layer's backward pass (``dz @ kernel.T``, or what depends on it).
    """
    _check_fused("sgd_update", x, dz, kernel, (kernel_trace,), bias, (bias_trace,))
    empty = jnp.zeros((0,), jnp.float32)
    b, mb = (empty, empty) if bias is None else (bias, bias_trace)
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (kernel, kernel_trace, b, mb))
    kernel, kernel_trace, b, mb = jax.ffi.ffi_call(
        "jb_fc_upd_sgd", outs, input_output_aliases={2: 0, 3: 1, 4: 2, 5: 3})(
        x, dz, kernel, kernel_trace, b, mb, jnp.asarray(lr, jnp.float32),
        empty if after is None else after, momentum=np.float32(momentum),
        weight_decay=np.float32(weight_decay), bias_weight_decay=np.float32(bias_weight_decay),
        nesterov=bool(nesterov))
    return kernel, kernel_trace, (None if bias is None else b), (None if bias is None else mb)


def adamw_update(x, dz, kernel, mu, nu, bias, bias_mu, bias_nu, lr, count, *, b1, b2, eps,
                 eps_root=0.0, weight_decay, bias_weight_decay=0.0, after=None):
    """One step of optax's ``adamw`` (``scale_by_adam``, ``add_decayed_weights``,
    ``scale_by_learning_rate``) for a dense layer whose gradients are ``x.T @ dz`` and
    ``sum(dz, 0)``, without forming them (as ``sgd_update``).

    ``mu``, ``nu`` (and ``bias_mu``, ``bias_nu``) are optax's ``ScaleByAdamState`` leaves of
    the kernel (and bias), float32; ``count`` that state's step count *before* this step
    (an integer scalar); ``lr`` the step's learning rate. ``weight_decay`` applies to the
    kernel, ``bias_weight_decay`` to the bias (optax's ``mask``). Returns the new
    ``(kernel, mu, nu, bias, bias_mu, bias_nu)`` (bias ones None without a bias), in place
    when the caller donates them; ``after`` as in ``sgd_update``.
    """
    _check_fused("adamw_update", x, dz, kernel, (mu, nu), bias, (bias_mu, bias_nu))
    count_inc = optax.safe_increment(jnp.asarray(count))
    # optax's bias corrections, computed as optax computes them (1 - decay**count, fp32)
    bc1, bc2 = 1 - b1 ** count_inc, 1 - b2 ** count_inc
    scalars = jnp.stack([jnp.asarray(lr, jnp.float32), bc1.astype(jnp.float32),
                         bc2.astype(jnp.float32)])
    empty = jnp.zeros((0,), jnp.float32)
    b, bm, bv = (empty,) * 3 if bias is None else (bias, bias_mu, bias_nu)
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (kernel, mu, nu, b, bm, bv))
    f32 = np.float32
    kernel, mu, nu, b, bm, bv = jax.ffi.ffi_call(
        "jb_fc_upd_adamw", outs, input_output_aliases={2: 0, 3: 1, 4: 2, 5: 3, 6: 4, 7: 5})(
        x, dz, kernel, mu, nu, b, bm, bv, scalars, empty if after is None else after,
        b1=f32(b1), b2=f32(b2), c1=f32(1 - b1), c2=f32(1 - b2), eps=f32(eps),
        eps_root=f32(eps_root), weight_decay=f32(weight_decay),
        bias_weight_decay=f32(bias_weight_decay))
    if bias is None:
        return kernel, mu, nu, None, None, None
    return kernel, mu, nu, b, bm, bv


def _check_fused(op, x, dz, kernel, kernel_state, bias, bias_state):
    if x.ndim != 2 or dz.ndim != 2 or kernel.shape != (x.shape[1], dz.shape[1]):
        raise ValueError(f"{op}: x {x.shape}, dz {dz.shape} and kernel {kernel.shape} "
                         "must be (N, C), (N, K) and (C, K)")
    if x.dtype != dz.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{op}: x and dz must share float32 or bfloat16, got {x.dtype}, {dz.dtype}")
    if any((bias is None) != (m is None) for m in bias_state):
        raise ValueError(f"{op}: give the bias and its optimizer state together, or neither")
    arrays = [kernel, *kernel_state] + ([] if bias is None else [bias, *bias_state])
    if any(a.dtype != jnp.float32 for a in arrays) or any(m.shape != kernel.shape for m in kernel_state) or (
            bias is not None and (bias.shape != (kernel.shape[1],)
                                  or any(m.shape != bias.shape for m in bias_state))):
        raise ValueError(f"{op}: kernel, bias and their optimizer state must be float32, the "
                         "state of its parameter's shape, the bias (K,)")
