"""Tree attention plan: segments, keys and work (exactness is in test_model_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.model import tree_mask_bool
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from ray_xlong.trajectory.tree_attention import tree_plan

# The module docstring's example: sys u1 >a1 | >a2 t1 >b1 S >s1 >s2 | >x1
KV_END = torch.tensor([[10, 10, 10, 9, 9, 9, 9, 9, 9, 10, 11, 12]])
VALID = torch.tensor([[True] * 10 + [False, False]])


def test_segments_of_the_docstring_example():
    plan = tree_plan(KV_END, VALID)
    assert [(s.start, s.stop, s.keys.tolist()) for s in plan.rows[0]] == [
        (0, 3, [0, 1, 2]), (3, 9, [0, 1, 2, 3, 4, 5, 6, 7, 8]), (9, 10, [0, 1, 2, 9])]
    assert plan.valid_lengths == (10,)


@pytest.mark.parametrize("chunk", [1, 2, 4, 256])
def test_chunks_see_exactly_what_the_mask_allows(chunk):
    batch = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=200)).process(
        synthetic_runs(4, groups=2, runs_per_group=2, config=SyntheticConfig.small())).packed
    plan = tree_plan(batch.attention_mask, batch.valid, chunk=chunk)
    mask = tree_mask_bool(batch.attention_mask)[:, 0]
    for r, segments in enumerate(plan.rows):
        covered = []
        for s in segments:
            assert s.stop - s.start <= chunk
            for q in range(s.start, s.stop):
                seen = {int(k) for k in s.keys[:s.num_prefix + q - s.start + 1]}
                assert seen == set(torch.nonzero(mask[r, q]).flatten().tolist())
                covered.append(q)
        assert covered == list(range(plan.valid_lengths[r]))


def test_work_never_exceeds_per_trajectory_work():
    runs = synthetic_runs(5, groups=2, runs_per_group=3, config=SyntheticConfig.small())
    tree = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=None)).process(runs)
    flat = TrajectoryProcessor(ProcessorConfig(pack="per_trajectory")).process(runs)
    per_traj = sum(n * (n + 1) // 2 for n in flat.packed.valid.sum(dim=1).tolist())
    assert tree_plan(tree.packed.attention_mask, tree.packed.valid, chunk=1).work <= per_traj

