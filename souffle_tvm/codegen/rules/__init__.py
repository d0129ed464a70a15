"""Our schedule rules, one per module, each a dlight ``ScheduleRule`` available on CUDA only
(``base.CUDAScheduleRule``): ``apply(func, target, tunable)`` returns a ``tvm.s_tir.Schedule``,
or ``None`` where the rule does not apply. ``codegen.schedule.default_rules`` orders them
with dlight's own rules for the stitched stages (256 threads, or 128 or 512 where a subprogram
takes that size):

- ``aligned_tiles.AlignedTiles``: an elementwise stage cut into its producer's blocks, where
  ``stitch.joint_tiles`` asked for that.
- ``row_chain.RowChain``: a row chain (attention) in one kernel, its rows held in shared memory.
- ``window_chain.WindowChain``: a contraction and the depthwise (windowed) reduction reading it in
  one kernel, the contraction's tile with its halo in shared memory (EfficientNet's expand ->
  depthwise).
- ``atomic_rows.AtomicRows``: the atomic form of a two-phase row sum (``atomicAdd``).
- ``partial_rows.PartialRows``: a two-phase reduction's first phase, tiled like its GEMM.
- ``tiled_combine.TiledCombine``: a two-phase reduction's combine and its consumer, tiled like
  the GEMM (so the GEMM's tile can stay on chip in a stitched kernel).
- ``tensorcore.TensorCoreMatmul``: fp16 and bf16 GEMMs on tensor cores with 8 warps (4 or 16).
- ``stitched_matmul.StitchedMatmul``: dlight's ``gpu.Matmul`` at 16 x 16 threads (8 x 16,
  16 x 32; reported as "Matmul").
- ``column_reduction.ColumnReduction``: a reduction over an outer axis, K over threadIdx.y.
- ``serial_reduction.SerialReduction``: many outputs of few terms (depthwise, grouped
  convolutions), one output per thread, where the latency model predicts it faster.
- ``row_reduction.RowReduction``: dlight's ``gpu.GeneralReduction`` at the block size
  (reported as "GeneralReduction").
- ``nothing_to_write.NothingToWrite``: a function that only writes empty tensors (first, at
  every block size and in TVM's own rule list: dlight divides by its zero extents).
"""

from .aligned_tiles import AlignedTiles
from .atomic_rows import AtomicRows
from .column_reduction import ColumnReduction
from .nothing_to_write import NothingToWrite
from .stitched_matmul import StitchedMatmul
from .partial_rows import PartialRows
from .row_chain import RowChain
from .row_reduction import RowReduction
from .serial_reduction import SerialReduction
from .tensorcore import TensorCoreMatmul
from .tiled_combine import TiledCombine
from .window_chain import WindowChain

__all__ = ["AlignedTiles", "AtomicRows", "ColumnReduction", "NothingToWrite", "StitchedMatmul", "PartialRows", "RowChain", "RowReduction", "SerialReduction",
           "TensorCoreMatmul", "TiledCombine", "WindowChain"]
