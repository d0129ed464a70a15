"""Co-residency, asked of a build's facts after ptxas: which stitched kernels do not fit as
planned (they spill, or leave fewer blocks co-resident than the GPU has SMs: a grid sync would
wait on blocks that cannot run), and which grid each cooperative kernel's measured registers and
shared memory let be co-resident. The ptxas loop (``pipeline.feedback``) acts on the answers;
``build.facts.check_coresidency`` refuses a build whose grid cannot be co-resident at all."""

from __future__ import annotations

from ..build.facts import BuildFacts
from ..cost import hardware


def over_budget(facts: BuildFacts, souffle, arch: str) -> dict[str, str]:
    """{stitched kernel function: what ptxas found} for kernels that spill or leave no block of
    the kernel co-resident on an SM: the partitioner's estimate was wrong about them. ``souffle``:
    what was built from (its ``stitched`` kernels)."""
    gpu = hardware.for_arch(arch)
    stitched = {k.function for k in souffle.stitched if len(k.stages) > 1}
    out = {}
    for k in facts.kernels:
        if k.primfunc not in stitched or k.registers is None:
            continue
        if k.spill_bytes:
            out[k.primfunc] = f"{k.spill_bytes} B of register spills ({k.registers} registers)"
        elif k.cooperative and (k.max_coresident or 0) < gpu.sms:   # no grid sync: nothing to wait for
            out[k.primfunc] = (f"{k.registers} registers and {k.shared_bytes} B shared memory leave "
                               f"{k.max_coresident} blocks co-resident, fewer than the {gpu.sms} SMs")
    return out


def coresident_grids(facts: BuildFacts, souffle) -> dict[str, int]:
    """{stitched kernel function: blocks} where the grid launched (from the static estimate)
    differs from what ptxas' figures let be co-resident and the stages can use: fewer (needed,
    or grid.sync() could deadlock) or more (more parallelism)."""
    stitched = {k.function: k for k in souffle.stitched}
    out = {}
    for k in facts.kernels:
        sk = stitched.get(k.primfunc)
        if sk is not None and k.cooperative and k.max_coresident:
            want = min(k.max_coresident, sk.max_blocks)
            if want != sk.grid:
                out[k.primfunc] = want
    return out
