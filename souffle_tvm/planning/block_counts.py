"""What a block of each stage executes (``cost.tir_counts``), counted in the form it is built in:
as a kernel of its own, or as a stage of a stitched kernel at a block size; kept across compiles
in one process and, on disk, across processes (``$SOUFFLE_TVM_CACHE/counts``).

The latency model prices a group's stages from these (``stage_work``), and a built stitched
kernel's stages carry them (``counted_alone``): the report prices it stage by stage as the
partitioner priced its window, where the kernel's own counts (its busiest and last blocks, all
stages together) cannot say which stage's few tiles carry the sectors."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import tvm
import tvm_ffi
from tvm import tirx

from ..build import executable
from ..core.files import atomic_write, cache_root, note_recomputed
from ..core.structural import ByStructure
from ..core.targets import is_cuda
from ..cost import tir_counts, tir_stats
from ..cost.work import BlockCounts, Stage
from ..errors import StitchError
from ..stitch import kernel
from .group_calls import GroupCalls


def stage_work(func: tirx.PrimFunc, lowered: list, unscheduled: tirx.PrimFunc, target, block: int | None = None
          ) -> list[Stage]:
    """The latency model's view of a group's lowered stages: the unscheduled function's
    footprint and flops (as the report counts them), the scheduled one's launch geometry, and
    what a block of each stage executes (``counted``)."""
    return counted(uncounted(func, lowered, unscheduled), func, lowered, target, block)


def uncounted(func: tirx.PrimFunc, lowered: list, unscheduled: tirx.PrimFunc) -> list[Stage]:
    nbytes = sum(tir_stats.block_footprints(unscheduled).values()) or tir_stats.primfunc_param_bytes(unscheduled)
    return tir_stats.work_stages(func, [(st.num_blocks, st.num_threads) for st in lowered], nbytes,
                                 sum(tir_stats.block_flops(unscheduled).values()))


def counted(stages: list[Stage], func: tirx.PrimFunc, lowered: list, target,
             block: int | None) -> list[Stage]:
    """``stages`` with what a block of each executes (``cost.tir_counts``): its K-loop steps,
    shared wavefronts and global sectors, which a small GEMV's (or a lane-per-row fallback's)
    time rests on more than its bytes. Counted in the
    form it is built in: as a kernel of its own (``block`` None), or as a stage of a
    ``block``-thread stitched kernel. The two differ: TVM's ThreadSync guards dlight's
    column-reduction K loop with a barrier each step in the first, not in the second (one flat
    thread index)."""
    if not is_cuda(target):
        return stages
    counts = _COUNTS(func, lambda: counts_of(func, lowered, target, block), key=(str(target), block))
    if len(counts) != len(stages):
        return stages
    return [dataclasses.replace(w, k_steps=c.k_steps, shared_wavefronts=c.shared_wavefronts, sectors=c.global_sectors)
            for w, c in zip(stages, counts)]


# What a block of each stage of a scheduled group executes, built alone (block None) or stitched
# at a block size, across compiles in one process (the zoo's repeated layers and models) and, on
# disk, across processes (``stored_path``).
_COUNTS = ByStructure()


# what the counts depend on besides the function: the counting, the one-stage stitch, the build
_COUNTED_BY = [tir_counts, kernel, executable]


def counts_of(func: tirx.PrimFunc, lowered: list, target, block: int | None) -> list:
    path = stored_path(func, target, block)
    if path is not None and path.exists():
        try:
            return [BlockCounts.from_dict(d) for d in json.loads(path.read_text())]
        except (ValueError, TypeError, KeyError) as err:
            note_recomputed(path, f"unreadable ({type(err).__name__})")
    if block is None:
        counts = executable.device_counts(func, target)
    else:
        counts = []
        for st in lowered:
            try:
                one = kernel.stitch([st], [list(range(len(st.params)))], st.num_blocks, block, target=target)
            except StitchError:
                return []
            counts += executable.device_counts(one.func, target)
    if path is not None:
        try:
            atomic_write(path, json.dumps([c.as_dict() for c in counts]))
        except OSError:     # a cache that cannot be written only costs the next process the count
            pass
    return counts


@functools.lru_cache(maxsize=1)
def _counting_version() -> str:
    digest = hashlib.sha256(tvm.__version__.encode())
    for module in _COUNTED_BY:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def stored_path(func: tirx.PrimFunc, target, block: int | None) -> Path | None:
    """Where the counts of ``func`` (built alone, or stitched at ``block``) are kept on disk (None
    where no cache can be written): by its structural hash (stable across processes, as MetaSchedule's database relies on), the
    target, the block size and the counting code's version."""
    key = hashlib.sha256(f"{tvm_ffi.structural_hash(func)}|{target}|{block}|{_counting_version()}".encode())
    try:
        root = cache_root() / "counts"
        root.mkdir(parents=True, exist_ok=True)
    except OSError:         # no writable cache: count in this process only
        return None
    return root / f"{key.hexdigest()[:32]}.json"


def counted_alone(stage_ids: list, work: list | None, calls: GroupCalls) -> list[dict | None]:
    """Per stage of a stitched kernel (``stage_ids``: ``StitchedKernel.stage_ids``): what one
    block of its tiles executes as the partitioner counted it (``work``: ``GroupFacts.work`` at
    the kernel's block size), None where it was not counted."""
    by_function = {}
    for g, i in calls.call_index.items():
        if work and g < len(work) and work[g]:
            by_function.setdefault(calls.calls[i].args[0].name_hint, work[g])
    out = []
    for sid in stage_ids:
        regions = by_function.get(sid.function, [])
        st = regions[sid.region or 0] if (sid.region or 0) < len(regions) else None
        out.append(None if st is None else {"tiles": st.tiles, "sectors": st.sectors, "k_steps": st.k_steps,
                                             "shared_wavefronts": st.shared_wavefronts})
    return out
