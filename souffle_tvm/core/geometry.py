"""Thread and tile geometry shared by the schedules, the transforms and the stitcher."""

STITCH_BLOCK = 256            # one block size for every stage of a stitched kernel: the partitioner's
# The block sizes a stitched subprogram may take instead (``partition.block_choice``): the latency
# model chooses per subprogram, after the partition was drawn at ``STITCH_BLOCK``.
STITCH_BLOCKS = (128, 256, 512)

# The stitched GEMM schedule's block tile (rows x columns): 16x16 threads, 4x4 outputs each, or
# 2x2 or 1x1 where the model predicts the smaller tile's count fills the grid better
# (``codegen.rules.StitchedMatmul``); at another block size, that size's thread grid.
MATMUL_THREADS, MATMUL_MICRO = 16, 4
MATMUL_THREAD_GRIDS = {128: (8, 16), 256: (MATMUL_THREADS, MATMUL_THREADS), 512: (16, 32)}   # (rows, columns)
MATMUL_MICROS = (4, 2, 1)
# Blocks of a stitched kernel resident per SM, which a stage's tiles should fill: ptxas gives
# stitched kernels about 80 registers per thread (zoo, sm_90), so 3 blocks of 256 threads.
STITCH_BLOCKS_PER_SM = 3
MATMUL_K_TILE = 16            # dlight's CUDA default; larger K tiles need more shared memory
# The K tiles a stitched SIMT GEMM may take instead: fewer, longer K steps, each one global
# load's round trip and a barrier, where a tile's K loop is its critical path
# (``codegen.rules.StitchedMatmul``).
MATMUL_K_TILES = (16, 32, 64)
STATIC_SHARED_LIMIT = 48 * 1024   # bytes a kernel may declare statically
