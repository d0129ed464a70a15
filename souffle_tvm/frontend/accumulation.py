"""bf16 contractions accumulated in float32, as TensorRT and cuBLAS do.

After ``--dtype bfloat16`` (``precision``), or for a model exported in bfloat16, a MatMul or
convolution of two bf16 operands would sum its K products in bf16: 8 bits of mantissa, so a
768-long dot product loses about two decimal digits, and tensor cores have no bf16 accumulator
at all. Here each such Relax call computes into float32 (``out_dtype``) and is cast back to bf16
after: operands and result stay two bytes in memory where the cast is the contraction's
epilogue (``transforms.vertical``), the sum does not round per term, and the GEMM reaches the
tensor-core rule as a (bf16, fp32) contraction (``codegen.rules.TensorCoreMatmul``).

The pass widens fp16 contractions too, but the importer applies it to bf16 alone: fp16 keeps
its fp16 sums (the ONNX backend asks for float32 ones its own way). Widened, a BERT-style
export under ``--dtype float16`` wrote one GEMM's float32 sum to memory (its cast back landed
in the next kernel: 1.8% more bytes), which is not yet resolved.
"""

from __future__ import annotations

import tvm
from tvm import relax

LOW = ("float16", "bfloat16")

#: Relax contractions with an ``out_dtype`` attribute, and the builder that makes each
_CONTRACTIONS = {
    "relax.matmul": lambda args, attrs: relax.op.matmul(*args, out_dtype="float32"),
    "relax.nn.conv1d": lambda args, attrs: relax.op.nn.conv1d(*args, **_conv_fields(attrs)),
    "relax.nn.conv2d": lambda args, attrs: relax.op.nn.conv2d(*args, **_conv_fields(attrs)),
}


def _conv_fields(attrs) -> dict:
    return {"strides": attrs.strides, "padding": attrs.padding, "dilation": attrs.dilation, "groups": attrs.groups,
            "data_layout": attrs.data_layout, "kernel_layout": attrs.kernel_layout, "out_layout": attrs.out_layout,
            "out_dtype": "float32"}


def _dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        make = _CONTRACTIONS.get(getattr(call.op, "name", ""))
        low = _dtype(call)
        if make is None or low not in LOW or {_dtype(a) for a in call.args} != {low}:
            return call
        wide = self.builder_.normalize(make(list(call.args), call.attrs))
        return relax.op.astype(wide, low)


@tvm.transform.module_pass(opt_level=0, name="souffle.AccumulateInFloat32")
def accumulate_in_float32(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every Relax function's fp16/bf16 matmuls and convolutions computed into float32 and cast
    back to their type (the rest of the module as it was)."""
    widen = _Widen(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = widen.visit_expr(func)
    return mod
