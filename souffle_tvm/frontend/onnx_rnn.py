"""ONNX recurrent operators (``LSTM``, ``GRU``) for TVM's Relax ONNX importer, which has none.

The recurrence is unrolled over the (static) sequence, but in a form that keeps the graph
small and the compiled code compact:

* the input projection X·Wᵀ for all time steps is ONE matmul per direction, split once;
* every time step is the same short chain of ops (matmul h·Rᵀ, add, split into gates,
  activations, cell update), so the per-step PrimFuncs are structurally identical and TVM
  deduplicates them: a 10-layer × 100-step LSTM has a handful of distinct kernels.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _onnx

from ..errors import DynamicShapeError, UnsupportedOperatorError

R = relax.op


def _static_shape(expr: relax.Expr, what: str) -> list[int]:
    dims = []
    for d in expr.ty.shape:
        if not hasattr(d, "value"):
            raise DynamicShapeError(f"{what} has a dynamic dimension ({d}); RNN sequence, batch and "
                                    "feature sizes must be static")
        dims.append(int(d.value))
    return dims


# ONNX activation name -> (number of alpha/beta parameters it consumes, builder).
def _activation(name: str, alpha: float | None, beta: float | None, dtype: str) -> Callable:
    c = lambda v: relax.const(v, dtype)  # noqa: E731
    table = {
        "sigmoid": lambda x: R.sigmoid(x),
        "tanh": lambda x: R.tanh(x),
        "relu": lambda x: R.nn.relu(x),
        "leakyrelu": lambda x: R.nn.leakyrelu(x, 0.01 if alpha is None else alpha),
        "hardsigmoid": lambda x: R.clip(R.add(R.multiply(x, c(0.2 if alpha is None else alpha)),
                                              c(0.5 if beta is None else beta)), 0.0, 1.0),
        "affine": lambda x: R.add(R.multiply(x, c(1.0 if alpha is None else alpha)), c(beta or 0.0)),
        "scaledtanh": lambda x: R.multiply(R.tanh(R.multiply(x, c(1.0 if beta is None else beta))),
                                           c(1.0 if alpha is None else alpha)),
        "softsign": lambda x: R.divide(x, R.add(R.abs(x), c(1.0))),
        "softplus": lambda x: R.log(R.add(R.exp(x), c(1.0))),
    }
    key = name.lower()
    if key not in table:
        raise UnsupportedOperatorError(f"RNN activation {name!r} is not supported "
                                       f"(supported: {', '.join(sorted(table))})")
    return table[key]


_TAKES_ALPHA = {"leakyrelu", "hardsigmoid", "affine", "scaledtanh", "elu", "thresholdedrelu"}
_TAKES_BETA = {"hardsigmoid", "affine", "scaledtanh"}


def _activations(attr: dict, defaults: list[str], directions: int, dtype: str) -> list[list[Callable]]:
    """Per direction, the list of activation callables, consuming alpha/beta in spec order."""
    names = [a.decode() if isinstance(a, bytes) else a for a in attr.get("activations", ())]
    names = names or defaults * directions
    if len(names) != len(defaults) * directions:
        raise UnsupportedOperatorError(f"expected {len(defaults) * directions} activations, got {names}")
    alphas = list(attr.get("activation_alpha", ()))
    betas = list(attr.get("activation_beta", ()))
    fns = []
    for n in names:
        a = alphas.pop(0) if n.lower() in _TAKES_ALPHA and alphas else None
        b = betas.pop(0) if n.lower() in _TAKES_BETA and betas else None
        fns.append(_activation(n, a, b, dtype))
    k = len(defaults)
    return [fns[d * k:(d + 1) * k] for d in range(directions)]


class _Recurrence:
    """Shared scaffolding of ONNX RNN nodes: layouts, directions, sequence_lens, stacking."""

    def __init__(self, bb: relax.BlockBuilder, inputs, attr, params, op_name: str):
        self.bb, self.inputs, self.attr, self.params, self.op_name = bb, inputs, attr, params, op_name
        x = inputs[0]
        self.layout = int(attr.get("layout", 0))
        if self.layout == 1:
            x = self.emit(R.permute_dims(x, [1, 0, 2]))
        self.x = x
        self.seq, self.batch, self.features = _static_shape(x, f"{op_name} input X")
        self.dtype = x.ty.dtype
        direction = attr.get("direction", b"forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        if direction not in ("forward", "reverse", "bidirectional"):
            raise UnsupportedOperatorError(f"{op_name} direction {direction!r} is not valid")
        self.direction = direction
        self.directions = 2 if direction == "bidirectional" else 1
        self.hidden = int(attr.get("hidden_size", _static_shape(inputs[2], "R")[-1]))
        self.clip = attr.get("clip")
        self._check_sequence_lens(inputs[4])

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.bb.emit(expr)

    def const(self, value: float) -> relax.Expr:
        return relax.const(value, self.dtype)

    def _check_sequence_lens(self, seq_lens) -> None:
        if seq_lens is None:
            return
        value = _onnx.get_constant(seq_lens, self.params)
        if not isinstance(value, tvm.ir.GenericConst):
            raise UnsupportedOperatorError(
                f"{self.op_name} with a run-time sequence_lens input is not supported; "
                "all sequences must have the static length of X")
        lens = value.value.numpy()
        if not np.all(lens == self.seq):
            raise UnsupportedOperatorError(
                f"{self.op_name} sequence_lens {lens.tolist()} differ from the sequence length "
                f"{self.seq}; variable-length (padded) sequences are not supported")

    def per_direction(self, tensor, d: int) -> relax.Expr | None:
        """Slice direction d out of a [num_directions, ...] tensor."""
        if tensor is None:
            return None
        return self.emit(R.squeeze(R.strided_slice(tensor, axes=[0], begin=[d], end=[d + 1]), [0]))

    def initial_state(self, tensor, d: int) -> relax.Expr:
        if tensor is None:
            return self.emit(R.zeros((self.batch, self.hidden), self.dtype))
        if self.layout == 1:  # [batch, dirs, H] -> [dirs, batch, H]
            tensor = self.emit(R.permute_dims(tensor, [1, 0, 2]))
        return self.per_direction(tensor, d)

    def time_steps(self, projected: relax.Expr) -> list[relax.Expr]:
        """Step t's slice [batch, G] of [seq, batch, G], as ``take`` with a constant index.

        Every step is then the same PrimFunc with a different index argument (a ``split``
        would lower to one kernel per output, a ``strided_slice`` to one PrimFunc per step),
        and FuseOps folds the take into the step's matmul + add.
        """
        return [self.emit(R.take(projected, relax.const(t, "int64"), axis=0, mode="clip")) for t in range(self.seq)]

    def interleaved(self, tensor: relax.Expr | None, n: int, blocks: int = 1) -> relax.Expr | None:
        """ONNX's gate-major ``[dirs, blocks*n*H, ...]`` (W, R; B has two blocks) reordered
        unit-major: entry ``n*u + k`` of each block is gate k of unit u. Any contiguous tile of
        a product's outputs then holds every gate of its units, so the cell update can run where
        the gates were computed (``planning.joint_tiles``). A constant (an initializer) is
        reordered here, so neither build pays for it at run time."""
        if tensor is None:
            return None
        h = self.hidden
        order = np.array([b * n * h + k * h + u for b in range(blocks) for u in range(h) for k in range(n)],
                         dtype="int64")
        value = _onnx.get_constant(tensor, self.params)
        if isinstance(value, tvm.ir.GenericConst):
            return relax.const(np.take(value.value.numpy(), order, axis=1))
        return self.emit(R.take(tensor, relax.const(order), axis=1, mode="clip"))

    def interleaved_gates(self, gates: relax.Expr, n: int) -> list[relax.Expr]:
        """The n gates of unit-major [batch, n*H] (``interleaved``) as strided slices."""
        return [R.strided_slice(gates, axes=[1], begin=[k], end=[n * self.hidden], strides=[n]) for k in range(n)]

    def maybe_clip(self, x: relax.Expr) -> relax.Expr:
        """ONNX ``clip``: bound a gate's pre-activation (peephole term included)."""
        if self.clip is None:
            return x
        return R.clip(x, -float(self.clip), float(self.clip))

    def outputs(self, hs_per_dir: list[list[relax.Expr]], finals: list[list[relax.Expr]]) -> relax.Tuple:
        """Y [seq, dirs, batch, H] (layout 0) and one [dirs, batch, H] tensor per final state."""
        ys = []
        for hs in hs_per_dir:
            ys.append(self.emit(R.concat([R.expand_dims(h, [0]) for h in hs], axis=0)))
        y = self.emit(R.concat([R.expand_dims(v, [1]) for v in ys], axis=1))
        states = [self.emit(R.concat([R.expand_dims(s, [0]) for s in per_dir], axis=0)) for per_dir in finals]
        if self.layout == 1:
            y = self.emit(R.permute_dims(y, [2, 0, 1, 3]))
            states = [self.emit(R.permute_dims(s, [1, 0, 2])) for s in states]
        return relax.Tuple([y, *states])


class LSTM(_onnx.OnnxOpConverter):
    """ONNX LSTM (opset 7 and 14): gates i, o, f, c; optional peepholes, clip, input_forget."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        rec = _Recurrence(bb, inputs, attr, params, "LSTM")
        H, dt = rec.hidden, rec.dtype
        w, r, b = inputs[1], inputs[2], inputs[3]
        init_h, init_c, peep = inputs[5], inputs[6], inputs[7]
        # the gates unit-major (``interleaved``): i, o, f, c of unit u in columns 4u..4u+3
        w, r, b = rec.interleaved(w, 4), rec.interleaved(r, 4), rec.interleaved(b, 4, blocks=2)
        acts = _activations(attr, ["Sigmoid", "Tanh", "Tanh"], rec.directions, dt)
        input_forget = bool(attr.get("input_forget", 0))

        hs_per_dir, final_h, final_c = [], [], []
        for d in range(rec.directions):
            f_act, g_act, h_act = acts[d]
            w_d, r_d = rec.per_direction(w, d), rec.per_direction(r, d)
            proj = rec.emit(R.matmul(rec.x, R.permute_dims(w_d, [1, 0])))          # [seq, batch, 4H]
            if b is not None:
                b_d = rec.per_direction(b, d)
                bias = rec.emit(R.add(R.strided_slice(b_d, axes=[0], begin=[0], end=[4 * H]),
                                      R.strided_slice(b_d, axes=[0], begin=[4 * H], end=[8 * H])))
                proj = rec.emit(R.add(proj, bias))
            r_t = rec.emit(R.permute_dims(r_d, [1, 0]))                              # [H, 4H]
            p_d = rec.per_direction(peep, d)
            if p_d is not None:
                p_i, p_o, p_f = (rec.emit(R.strided_slice(p_d, axes=[0], begin=[k * H], end=[(k + 1) * H]))
                                 for k in range(3))
            xs = rec.time_steps(proj)
            h, c = rec.initial_state(init_h, d), rec.initial_state(init_c, d)
            reverse = rec.direction == "reverse" or d == 1
            order = range(rec.seq - 1, -1, -1) if reverse else range(rec.seq)
            hs = [None] * rec.seq
            for t in order:
                gates = rec.emit(R.add(R.matmul(h, r_t), xs[t]))
                gi, go, gf, gc = rec.interleaved_gates(gates, 4)
                if p_d is not None:
                    gi = R.add(gi, R.multiply(p_i, c))
                    gf = R.add(gf, R.multiply(p_f, c))
                clip = rec.maybe_clip
                i = rec.emit(f_act(clip(gi)))
                f = rec.emit(R.subtract(rec.const(1.0), i) if input_forget else f_act(clip(gf)))
                c = rec.emit(R.add(R.multiply(f, c), R.multiply(i, g_act(clip(gc)))))
                if p_d is not None:
                    go = R.add(go, R.multiply(p_o, c))
                h = rec.emit(R.multiply(f_act(clip(go)), h_act(c)))
                hs[t] = h
            hs_per_dir.append(hs)
            final_h.append(h)
            final_c.append(c)
        return rec.outputs(hs_per_dir, [final_h, final_c])

    _impl_v14 = _impl_v7


class GRU(_onnx.OnnxOpConverter):
    """ONNX GRU (opset 7 and 14): gates z, r, h; ``linear_before_reset`` 0 or 1 (PyTorch's), clip.

    ``linear_before_reset=1`` applies the reset gate after the recurrent matmul, r ⊙ (h·R_hᵀ + Rb_h),
    so one [H, 3H] matmul per step serves all gates; with 0 it applies before, (r ⊙ h)·R_hᵀ, which
    needs a second, dependent matmul per step.
    """

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        rec = _Recurrence(bb, inputs, attr, params, "GRU")
        H, dt = rec.hidden, rec.dtype
        w, r, b, init_h = inputs[1], inputs[2], inputs[3], inputs[5]
        acts = _activations(attr, ["Sigmoid", "Tanh"], rec.directions, dt)
        before_reset = bool(attr.get("linear_before_reset", 0))
        clip = rec.maybe_clip

        def part(t, k, n=1):  # gate block(s) k..k+n-1 of the last axis
            return R.strided_slice(t, axes=[t.ty.ndim - 1], begin=[k * H], end=[(k + n) * H])

        hs_per_dir, final_h = [], []
        for d in range(rec.directions):
            f_act, g_act = acts[d]
            w_d, r_d = rec.per_direction(w, d), rec.per_direction(r, d)
            proj = rec.emit(R.matmul(rec.x, R.permute_dims(w_d, [1, 0])))          # [seq, batch, 3H]
            rb_h = None
            if b is not None:
                b_d = rec.per_direction(b, d)
                wb, rb = rec.emit(part(b_d, 0, 3)), rec.emit(part(b_d, 3, 3))
                # Rb_z, Rb_r (and Rb_h unless it sits inside the reset product) are input-independent.
                if before_reset:
                    rb_h = rec.emit(part(rb, 2))
                    rb = R.concat([part(rb, 0, 2), R.zeros((H,), dt)], axis=0)
                proj = rec.emit(R.add(proj, R.add(wb, rb)))
            if before_reset:
                r_all = rec.emit(R.permute_dims(r_d, [1, 0]))                         # [H, 3H]
            else:
                r_zr = rec.emit(R.permute_dims(R.strided_slice(r_d, axes=[0], begin=[0], end=[2 * H]), [1, 0]))
                r_h = rec.emit(R.permute_dims(R.strided_slice(r_d, axes=[0], begin=[2 * H], end=[3 * H]), [1, 0]))
            xs = rec.time_steps(proj)
            h = rec.initial_state(init_h, d)
            reverse = rec.direction == "reverse" or d == 1
            order = range(rec.seq - 1, -1, -1) if reverse else range(rec.seq)
            hs = [None] * rec.seq
            for t in order:
                x_t = xs[t]
                if before_reset:
                    hr = rec.emit(R.matmul(h, r_all))                                 # [batch, 3H]
                    zr = rec.emit(f_act(clip(R.add(part(x_t, 0, 2), part(hr, 0, 2)))))
                    z, reset = part(zr, 0), part(zr, 1)
                    rec_h = part(hr, 2) if rb_h is None else R.add(part(hr, 2), rb_h)
                    n = rec.emit(g_act(clip(R.add(part(x_t, 2), R.multiply(reset, rec_h)))))
                else:
                    zr = rec.emit(f_act(clip(R.add(part(x_t, 0, 2), R.matmul(h, r_zr)))))
                    z, reset = part(zr, 0), part(zr, 1)
                    n = rec.emit(g_act(clip(R.add(part(x_t, 2), R.matmul(R.multiply(reset, h), r_h)))))
                h = rec.emit(R.add(n, R.multiply(z, R.subtract(h, n))))               # (1-z)·n + z·h
                hs[t] = h
            hs_per_dir.append(hs)
            final_h.append(h)
        return rec.outputs(hs_per_dir, [final_h])

    _impl_v14 = _impl_v7


CONVERTERS = {"LSTM": LSTM, "GRU": GRU}
