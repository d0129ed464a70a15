"""``partition.groups``: what a group is before any rule marks it, and the name it reports (the
report's groups and the partitioner's reasons name kernels by it). Written for the mutation pass
over groups.py (results/mutation-2026-12-08/), whose survivors these fail on."""

from tvm import te

from souffle_tvm.partition.groups import Group


def _scale_then_sum():
    x = te.placeholder((4, 8), name="x")
    k = te.reduce_axis((0, 8), "k")
    scaled = te.compute((4, 8), lambda i, j: x[i, j] * 2.0, name="scaled")
    total = te.compute((4,), lambda i: te.sum(scaled[i, k], axis=k), name="total")
    return scaled, total


def test_a_group_is_named_for_its_reduction_wherever_it_stands():
    scaled, total = _scale_then_sum()
    assert Group([scaled, total]).anchor is total
    assert Group([scaled, total]).name == "total"      # the anchor, not the first member
    assert Group([scaled]).anchor is None
    assert Group([scaled]).name == "scaled"            # without a reduction: its first member


def test_a_group_is_a_plain_kernel_until_a_rule_marks_it():
    """A rule that forms a group says what else it is; a group made without a word is one
    kernel of its members, neither a prologue (which would pull the next contraction in), a row
    chain, nor a window chain, and has no reason yet."""
    g = Group()
    assert g.members == [] and g.opaque is None
    assert g.reason == "" and g.window_reason == ""
    assert g.prologue is False and g.row_chain is False and g.window_at == 0
    scaled, _ = _scale_then_sum()
    assert Group([scaled]).members == [scaled] and Group([scaled]).members is not Group([scaled]).members
