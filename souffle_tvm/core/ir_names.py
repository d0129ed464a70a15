"""Names one step stamps on IR and a later step reads.

They live here, below every step, so that the writer and the reader share them without one
importing the other (a transform must not import code generation to learn a tag's name).
"""

PARTIAL_TAG = "souffle_partial"       # te.compute tag of a two-phase reduction's first phase
ATOMIC_ATTR = "souffle_atomic"        # ... on a first phase accumulated with atomics (AtomicRows)
TILE_ATTR = "souffle_partial_tile"    # the GEMM tile width a first-phase stage reduces
ROW_TILE_ATTR = "souffle_partial_rows"  # ... and the GEMM tile's row count (one block's rows)
LANES_ATTR = "souffle_partial_lanes"   # ... and the lanes that share a row of it (a partial each)
COMBINE_TILE_ATTR = "souffle_combine_tile"  # on a two-phase combine: its GEMM's tile as rows * 65536 + cols
K_OPAQUE = 8                          # Relax OpPatternKind::kOpaque, on every PrimFunc we emit
GEMM_TILE_ATTR = "souffle.gemm_tile"  # on a stitched GEMM stage's schedule: its output tile (rows, columns)
GEMM_K_TILE_ATTR = "souffle.gemm_k_tile"  # ... and, on a SIMT one, its K tile (elements per K step)
# on an unscheduled elementwise group PrimFunc: the blocks to cut it into, its producer's (``AlignedTiles``)
ALIGNED_TILES_ATTR = "souffle.aligned_tiles"
SOURCE_ATTR = "souffle.schedule"      # on scheduled group PrimFuncs: "database" or "default: <rule>"
NOTE_ATTR = "souffle.schedule_note"   # why a tuning-database record was not used
FORM_ATTR = "souffle.form"            # on scheduled group PrimFuncs: its schedule form, "<rule>@<threads>"
STAGE_BLOCKS = "souffle.stage_blocks"     # on a stitched stage loop: the stage's own block count
# The emulator's mark on a vectorized loop it runs as a serial loop inside each thread: one
# access per thread on the GPU (``runtime.traffic_probe`` counts its elements as one request).
EMULATED_VECTOR = "souffle.emulated_vector"
STAGE_THREADS = "souffle.stage_threads"   # ... and its thread count
STAGE_LANE = "souffle.stage_lane"         # ... and, where not 0, the block its virtual block 0 runs on (``waves``)
FUSED = "souffle.fused_stages"            # on a loop running several stages per virtual block (``stitch.channel``)
MIN_BLOCKS_ATTR = "souffle.min_blocks_per_sm"   # on a stitched PrimFunc: its register cap, as blocks per SM
TVM_MIN_BLOCKS = "tirx.launch_bounds_min_blocks_per_sm"  # TVM's key: __launch_bounds__(threads, blocks)
PREFETCH = "souffle.prefetch"         # on a V4 L2 prefetch loop: a hint, no semantics
GROUP_PREFIX = "souffle_"             # name prefix of every group PrimFunc main calls (opaque calls have others)
