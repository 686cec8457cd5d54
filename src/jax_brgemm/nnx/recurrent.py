"""``jb.nnx.RNN`` and ``jb.nnx.LSTM``: ``flax.nnx.RNN`` over an LSTM cell as one fused
``jb.lstm`` call per pass, with the stock modules' constructors, state and results."""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn import initializers
from flax.nnx.nn import linear as stock_linear
from flax.nnx.nn import recurrent as stock_recurrent
from flax.nnx.nn.linear import default_kernel_init
from flax.nnx.transforms import iteration
from flax.typing import Dtype, Initializer, PromoteDtypeFn
from jax import lax

from jax_brgemm import _validate as check
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.recurrent import lstm_on_kernels, seq_lengths_problem
from jax_brgemm.nnx.linear import _positive_int

Array = tp.Any


def _stock_linear(layer, with_bias: bool) -> bool:
    """``layer`` is a plain ``nnx.Linear`` that computes ``x @ kernel (+ bias)``."""
    return (type(layer) is stock_linear.Linear and layer.dot_general is lax.dot_general
            and layer.preferred_element_type is None and (layer.bias is not None) == with_bias)


def lstm_params(cell) -> Decision:
    """``Decision((kernel_i (C, 4K), kernel_h (K, 4K), bias (4K,)))``, gates in the order i,
    f, g, o, of a stock ``nnx.OptimizedLSTMCell`` or ``nnx.LSTMCell`` (both compute the same
    gates from the same parameters, stored differently), or why the fused kernels cannot run
    it."""
    if type(cell) not in (stock_recurrent.OptimizedLSTMCell, stock_recurrent.LSTMCell):
        return Decision.stock(f"cell {type(cell).__name__}")
    if not _adapt.sigmoid_tanh_gates(cell):
        return Decision.stock("gate_fn / activation_fn other than sigmoid / tanh")
    if cell.promote_dtype is not nnx_dtypes.promote_dtype:
        return Decision.stock("custom promote_dtype")
    if type(cell) is stock_recurrent.OptimizedLSTMCell:
        inputs, hidden = [cell.dense_i], [cell.dense_h]
    else:
        inputs = [cell.ii, cell.if_, cell.ig, cell.io]
        hidden = [cell.hi, cell.hf, cell.hg, cell.ho]
    if not all(_stock_linear(x, False) for x in inputs) or not all(
            _stock_linear(h, True) for h in hidden):
        return Decision.stock("modified gate layers")
    kernel_i = jnp.concatenate([x.kernel[...] for x in inputs], axis=-1)
    kernel_h = jnp.concatenate([h.kernel[...] for h in hidden], axis=-1)
    bias = jnp.concatenate([h.bias[...] for h in hidden], axis=-1)
    k = cell.hidden_features
    if kernel_h.shape != (k, 4 * k) or kernel_i.shape != (cell.in_features, 4 * k):
        return Decision.stock("parameter shapes do not match the cell's sizes")
    if any(np.dtype(a.dtype) not in check.KERNEL_DTYPES for a in (kernel_i, kernel_h, bias)):
        return Decision.stock("parameters neither float32 nor bfloat16")
    return Decision((kernel_i, kernel_h, bias))


def _scan_reproducible(rnn) -> str:
    """Why the fused call would not compute what ``rnn``'s scan does ("" when it would)."""
    state_axes = rnn.state_axes
    axes = state_axes.axes if isinstance(state_axes, iteration.StateAxes) else tuple(
        state_axes.values())
    # parameters carried or broadcast over time are the same parameters at every step
    if any(a is not None and a is not iteration.Carry for a in axes):
        return "state_axes scanning the cell's state over time"
    if rnn.broadcast_rngs is not None:
        return "broadcast_rngs"
    return ""


class RNN(stock_recurrent.RNN):
    """A drop-in for ``flax.nnx.RNN`` (a subclass, with the same constructor and state) that
    runs a stock ``nnx.OptimizedLSTMCell`` or ``nnx.LSTMCell`` over the whole sequence as one
    fused ``jb.lstm`` call per pass.

    The kernels run when the cell's gates are the default sigmoid / tanh, its computation
    dtype float32 or bfloat16 with Flax's ``promote_dtype``, ``state_axes`` carries or
    broadcasts the cell's state and ``broadcast_rngs`` is None. Every call convention of the
    stock module holds: ``initial_carry`` (or the cell's ``initialize_carry`` from the
    module's ``rngs``, consumed as the stock module does), ``return_carry``, ``time_major``,
    ``reverse`` / ``keep_order``, ``seq_lengths`` (with ``return_carry=True`` each
    sequence's own last carry, as the stock module selects it), any number of batch dims.
    Other cells and configurations, and ``seq_lengths`` with ``return_carry=True`` over more
    than one batch dim, run the stock scan.
    """

    def __call__(self, inputs: Array, *, initial_carry=None, seq_lengths: Array | None = None,
                 return_carry: bool | None = None, time_major: bool | None = None,
                 reverse: bool | None = None, keep_order: bool | None = None,
                 rngs: rnglib.Rngs | rnglib.RngStream | None = None):
        call = dict(initial_carry=initial_carry, seq_lengths=seq_lengths, return_carry=return_carry,
                    time_major=time_major, reverse=reverse, keep_order=keep_order, rngs=rngs)
        error, why = _input_problem(self, inputs, **call)
        if error is not None:
            raise error(f"jb.nnx.{type(self).__name__}: {why}")
        y, why = rnn_on_kernels(self, inputs, **call)
        return super().__call__(inputs, **call) if why else y


def _options(rnn, return_carry, time_major, reverse, keep_order) -> dict:
    """The call's options, the module's fields where the call leaves them None."""
    return dict(return_carry=rnn.return_carry if return_carry is None else return_carry,
                time_major=rnn.time_major if time_major is None else time_major,
                reverse=rnn.reverse if reverse is None else reverse,
                keep_order=rnn.keep_order if keep_order is None else keep_order)


def _input_problem(rnn, inputs, *, initial_carry, seq_lengths, rngs, **options):
    """``(None, "")``, or ``(the exception a module raises, why)`` for inputs, an initial
    carry or (with ``return_carry``) ``seq_lengths`` of the wrong shape or dtype for an LSTM
    cell; other cells are the stock scan's to check."""
    del rngs
    opts = _options(rnn, **options)
    cell = rnn.cell
    if not lstm_params(cell).taken:
        return None, ""
    layout = "(time, *batch, features)" if opts["time_major"] else "(*batch, time, features)"
    if (not hasattr(inputs, "shape") or len(inputs.shape) < 2
            or inputs.shape[-1] != cell.in_features):
        return ValueError, (f"inputs must be {layout} with features = in_features = "
                            f"{cell.in_features}, got shape {jnp.shape(inputs)}")
    if seq_lengths is not None and opts["return_carry"]:
        error, why = seq_lengths_problem(inputs, seq_lengths, opts["time_major"])
        if error is not None:
            return error, why
    if initial_carry is not None:
        time_axis = 0 if opts["time_major"] else len(inputs.shape) - 2
        hidden = inputs.shape[:time_axis] + inputs.shape[time_axis + 1:-1] + (cell.hidden_features,)
        if (not isinstance(initial_carry, (tuple, list)) or len(initial_carry) != 2
                or any(jnp.shape(a) != hidden for a in initial_carry)):
            return ValueError, (f"initial_carry must be a pair (c, h) of arrays shaped "
                                f"(*batch, hidden_features) = {hidden}, got "
                                f"{jax.tree.map(jnp.shape, initial_carry)}")
    return None, ""


def rnn_on_kernels(rnn, inputs, *, initial_carry=None, seq_lengths=None, return_carry=None,
                   time_major=None, reverse=None, keep_order=None, rngs=None) -> Decision:
    """What ``flax.nnx.RNN`` ``rnn`` computes on these arguments, on the fused kernels, as a
    ``Decision``: a stock call of the same arguments computes it when it is not taken.

    The rng stream is taken (and the carry initialized from it) only when the kernels run,
    so the stock call that otherwise runs takes it as it would."""
    opts = _options(rnn, return_carry, time_major, reverse, keep_order)
    params = lstm_params(rnn.cell)
    why = params.reason or _scan_reproducible(rnn)
    if not why:
        _, why = _input_problem(rnn, inputs, initial_carry=initial_carry, seq_lengths=seq_lengths,
                                rngs=rngs, return_carry=return_carry, time_major=time_major,
                                reverse=reverse, keep_order=keep_order)
    if not why and seq_lengths is not None and opts["return_carry"]:
        why = seq_lengths_problem(inputs, seq_lengths, opts["time_major"])[1]
    if why:
        return Decision.stock(why)
    kernel_i, kernel_h, bias = params.value
    cell, inputs = rnn.cell, jnp.asarray(inputs)
    # the stock cell's computation dtype over the whole sequence (its carry initializes in
    # param_dtype), decided before the rng stream is taken
    h0 = jnp.zeros((), cell.param_dtype) if initial_carry is None else initial_carry[1]
    dtype, why = _adapt.computation_dtype(cell.dtype, inputs, h0, kernel_i, kernel_h, bias)
    if why:
        return Decision.stock(why)
    # the stock module's rng stream (forked on every call) and carry, taken as it takes them
    rngs = rnn.rngs if rngs is None else rngs
    if isinstance(rngs, rnglib.Rngs):
        rngs = rngs.carry.fork()
    if initial_carry is None:
        time_axis = 0 if opts["time_major"] else inputs.ndim - 2
        initial_carry = cell.initialize_carry(inputs.shape[:time_axis] + inputs.shape[time_axis + 1:],
                                              rngs)
    c0, h0 = (jnp.asarray(a) for a in initial_carry)
    return Decision(lstm_on_kernels(inputs.astype(dtype), kernel_i, kernel_h, bias, (c0, h0),
                                    dtype=dtype, seq_lengths=seq_lengths, **opts))


class LSTM(RNN):
    """An LSTM over a whole sequence on jax_brgemm's fused LSTM kernels: a drop-in for
    ``flax.nnx.RNN(flax.nnx.OptimizedLSTMCell(in_features, hidden_features, ...))``.

    Built with the same arguments and ``rngs`` it holds the same state (``cell.dense_i``,
    ``cell.dense_h`` parameters and the module's carry rng stream), so ``nnx.state`` trees
    and checkpoints interchange; it is a ``jb.nnx.RNN`` over that cell, so it computes and
    falls back as that does::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jax_brgemm.nnx
      >>> layer = jax_brgemm.nnx.LSTM(3, 4, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 5, 3))).shape
      (2, 5, 4)

    Args:
      in_features, hidden_features, gate_fn, activation_fn, kernel_init,
        recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
        keep_rngs, rngs, kernel_metadata, recurrent_kernel_metadata, bias_metadata: the
        cell's, as ``flax.nnx.OptimizedLSTMCell``'s. ``dtype`` float32 or bfloat16 runs on the
        kernels (bfloat16 multiplies with float32 accumulation; the cell state is float32).
      time_major, return_carry, reverse, keep_order, unroll, state_axes, broadcast_rngs: as
        ``flax.nnx.RNN``'s (``unroll`` only matters to the stock scan).
      carry_rngs: ``flax.nnx.RNN``'s ``rngs`` (the stream that initializes the carry when
        no ``initial_carry`` is given; default: a fresh stream, as the stock module's).
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        gate_fn: tp.Callable[..., tp.Any] = nnx.sigmoid,
        activation_fn: tp.Callable[..., tp.Any] = nnx.tanh,
        kernel_init: Initializer = default_kernel_init,
        recurrent_kernel_init: Initializer = initializers.orthogonal(),
        bias_init: Initializer = initializers.zeros_init(),
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        carry_init: Initializer | None = None,
        promote_dtype: PromoteDtypeFn = nnx_dtypes.promote_dtype,
        keep_rngs: bool = False,
        rngs: rnglib.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        recurrent_kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        time_major: bool = False,
        return_carry: bool = False,
        reverse: bool = False,
        keep_order: bool = False,
        unroll: int = 1,
        state_axes: tp.Mapping[str, tp.Any] | None = None,
        broadcast_rngs: tp.Any = None,
        carry_rngs: rnglib.Rngs | bool = True,
    ):
        _positive_int("jb.nnx.LSTM", in_features=in_features, hidden_features=hidden_features)
        cell = stock_recurrent.OptimizedLSTMCell(
            in_features, hidden_features, gate_fn=gate_fn, activation_fn=activation_fn,
            kernel_init=kernel_init, recurrent_kernel_init=recurrent_kernel_init,
            bias_init=bias_init, dtype=dtype, param_dtype=param_dtype, carry_init=carry_init,
            promote_dtype=promote_dtype, keep_rngs=keep_rngs, rngs=rngs,
            kernel_metadata=kernel_metadata, recurrent_kernel_metadata=recurrent_kernel_metadata,
            bias_metadata=bias_metadata)
        super().__init__(cell, time_major=time_major, return_carry=return_carry, reverse=reverse,
                         keep_order=keep_order, unroll=unroll, state_axes=state_axes,
                         broadcast_rngs=broadcast_rngs, rngs=carry_rngs)
