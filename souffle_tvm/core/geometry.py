"""Thread and tile geometry shared by the schedules, the transforms and the stitcher."""

STITCH_BLOCK = 256            # one block size for every stage of a stitched kernel

# The stitched GEMM schedule's block tile (rows x columns): 16x16 threads, 4x4 outputs each.
MATMUL_THREADS, MATMUL_MICRO = 16, 4
MATMUL_TILE = MATMUL_THREADS * MATMUL_MICRO
MATMUL_K_TILE = 16            # dlight's CUDA default; larger K tiles need more shared memory
STATIC_SHARED_LIMIT = 48 * 1024   # bytes a kernel may declare statically
