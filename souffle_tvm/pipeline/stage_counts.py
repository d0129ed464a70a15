"""What a block of each stage of a stitched kernel executes, as the partitioner counted it: the
report prices a built kernel stage by stage from these (``report.assemble.stage_plan``), as the
partitioner priced its window, where the kernel's own counts (its busiest and last blocks, all
stages together) cannot say which stage's few tiles carry the sectors."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .policies import GroupCalls


def counted_alone(stage_ids: list, work: list | None, calls: "GroupCalls") -> list[dict | None]:
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
