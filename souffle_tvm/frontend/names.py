"""Exporters' tensor names → C identifiers, where they enter generated code.

Exporters name tensors ``/layers.0/attn/Constant_3_output_0`` (torch), ``model/dense_2/BiasAdd:0``
(TF/Keras) or ``jax2tf_fn_/Const_7`` (JAX). TVM's ONNX importer keeps initializer names as
they are (only ``onnx::`` is dropped) and makes input names only partly valid, and those names
become kernel parameter names in the CUDA source (``float* __restrict__ model/dense_2/...``),
which nvcc rejects. The Relax ``main`` that ``import_onnx`` returns therefore has parameters
named by ``c_identifiers``; the ONNX names stay in ``ImportedModel.inputs`` (what the report,
``--inputs`` and errors use) and in ``ImportedModel.names``.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import relax

# Words a kernel parameter may not be named (C/C++ keywords and CUDA's built-in variables);
# TVM appends nothing to some parameter names, so ``float`` would reach the source as is.
_RESERVED = frozenset("""
auto bool break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union
unsigned void volatile while class delete new private protected public template this throw try
namespace operator virtual friend using typename true false nullptr half
threadIdx blockIdx blockDim gridDim warpSize main
""".split())
_INVALID = re.compile(r"[^A-Za-z0-9_]")
_VALID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def c_identifier(name: str) -> str:
    """``name`` if it is a usable C identifier, else with every character C does not allow
    replaced by ``_`` (runs of ``_`` by one, none at the ends), not starting with a digit, and
    not a reserved word (``__x`` is reserved to the compiler too)."""
    if _VALID.fullmatch(name) and name not in _RESERVED and not name.startswith("__"):
        return name
    ident = re.sub(r"_+", "_", _INVALID.sub("_", name)).strip("_") or "t"
    if ident[0].isdigit() or ident in _RESERVED or ident.startswith("__"):
        ident = f"t_{ident}"
    return ident


def c_identifiers(names: list[str]) -> list[str]:
    """One valid, distinct C identifier per name, in order (``a/b`` and ``a.b`` both become
    ``a_b``: the second gets ``a_b_1``). A name that is already one is kept where no earlier
    name took it."""
    taken = set(n for n in names if c_identifier(n) == n)
    out, used = [], set()
    for n in names:
        base = c_identifier(n)
        ident, k = base, 0
        # a renamed name never takes an identifier some other name already has as its own
        while ident in used or (ident != n and ident in taken):
            k += 1
            ident = f"{base}_{k}"
        used.add(ident)
        out.append(ident)
    return out


def rename_params(mod: tvm.IRModule, func_name: str = "main") -> tuple[tvm.IRModule, dict[str, str]]:
    """``mod`` with ``func_name``'s parameters renamed by ``c_identifiers``; also returns
    {new name: old name} for those that changed."""
    func = mod[func_name]
    new_names = c_identifiers([p.name for p in func.params])
    if all(p.name == n for p, n in zip(func.params, new_names)):
        return mod, {}
    subst = {p: relax.Var(n, p.ty) for p, n in zip(func.params, new_names) if p.name != n}
    # structural_map rebuilds every node that holds a replaced var: the params and the body
    renamed = tvm_ffi.structural_map(func, (tvm.ir.Var, lambda v: subst.get(v, v)))
    out = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
    out[func_name] = renamed
    return out, {subst[p].name: p.name for p in subst}
