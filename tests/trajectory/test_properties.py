"""Property tests of the processor's invariants over randomly branching runs (hypothesis).

Oracles are brute force over prefixes (see ``oracles.py``): a token at a position is its root
path as a tuple.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ray_xlong.trajectory import (PrefixTree, ProcessorConfig, TrajectoryProcessor, assemble,
                                  select)
from ray_xlong.trajectory.model import tree_mask_bool
from ray_xlong.trajectory.selection import selection_key
from tests.trajectory.oracles import generated_prefixes, kept_prefixes, prefixes
from tests.trajectory.strategies import as_array_calls, branching_run, run_batches

SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(branching_run())
def test_assembly_round_trip_every_output_token_trainable_exactly_once(run):
    trajs = assemble(run)
    tree = PrefixTree.build(run.run_id, trajs)
    trainable = set()
    for node in tree.nodes():
        path = _root_path(node)
        for g in node.gen:
            for k in range(g.lo, g.hi):
                key = path[:node.depth + k + 1]
                assert key not in trainable                 # each position once
                trainable.add(key)
    assert trainable == generated_prefixes(run)
    assert tree.num_tokens == len(kept_prefixes(trajs))
    # every call belongs to exactly one trajectory, in order
    assert sorted(i for t in trajs for i in t.call_indices) == list(range(len(run.calls)))


@SETTINGS
@given(branching_run(), st.integers(1, 6))
def test_count_once_and_cap(run, k):
    kept, dropped = select(assemble(run), k)
    assert len(kept) == min(k, len(kept) + len(dropped))
    keys = [selection_key(t) for t in kept + dropped]
    assert keys == sorted(keys)                             # ranked, kept first
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=k, pack="none")).process(
        [run])
    expected = generated_prefixes(run) & kept_prefixes(kept)
    assert batch.stats.trainable_tokens == len(expected)
    assert batch.stats.weighted_trainable_tokens == len(expected)
    weighted = set()
    for t in batch.trajectories:
        toks = [int(x) for x in t.token_ids]
        for pos in (i for i, w in enumerate(t.loss_weights) if w):
            assert t.loss_weights[pos] == 1.0
            key = tuple(toks[:pos + 1])
            assert key not in weighted
            weighted.add(key)
    assert weighted == expected


@SETTINGS
@given(branching_run())
def test_numpy_and_list_ids_give_the_same_batch(run):
    cfg = ProcessorConfig(pack="tree")
    a = TrajectoryProcessor(cfg).process([run]).packed
    b = TrajectoryProcessor(cfg).process([as_array_calls(run)]).packed
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.target_ids.tolist() == b.target_ids.tolist()


@settings(max_examples=80, deadline=None)
@given(run_batches(), st.integers(1, 5), st.sampled_from([None, 8, 64]))
def test_packing_loses_and_duplicates_nothing(runs, k, row_tokens):
    cfg = dict(max_trajectories_per_run=k, row_tokens=row_tokens)
    tree = TrajectoryProcessor(ProcessorConfig(pack="tree", **cfg)).process(runs)
    flat = TrajectoryProcessor(ProcessorConfig(pack="per_trajectory", **cfg)).process(runs)
    tp, fp = tree.packed, flat.packed
    # mask = ancestor-or-self, position = depth: each column's attended tokens spell its root path
    mask = tree_mask_bool(tp.attention_mask)[:, 0]
    paths_by_row = []
    for r in range(tp.input_ids.shape[0]):
        ids = tp.input_ids[r].tolist()
        paths = []
        for i in range(len(ids)):
            path = tuple(ids[j] for j in range(i + 1) if mask[r, i, j])
            if tp.valid[r, i]:
                assert len(path) - 1 == int(tp.position_ids[r, i])
            paths.append(path)
        paths_by_row.append(paths)
    real = [p for r, paths in enumerate(paths_by_row) for i, p in enumerate(paths)
            if tp.valid[r, i]]
    # a row may hold several runs: a path is unique within its run's block
    assert len(real) == tree.stats.unique_tokens
    expected_tokens = sum(len(kept_prefixes([t for t in tree.trajectories if t.run_id == rid]))
                          for rid in tree.trees)
    assert len(real) == expected_tokens
    # targets: same (path + token) sequence in both layouts, no duplicates within a run
    tree_targets = [paths_by_row[r][s] + (t,) for r, s, t in
                    zip(tp.target_row.tolist(), tp.target_src.tolist(), tp.target_ids.tolist())]
    flat_targets = [tuple(fp.input_ids[r, :s + 1].tolist()) + (t,) for r, s, t in
                    zip(fp.target_row.tolist(), fp.target_src.tolist(), fp.target_ids.tolist())]
    assert tree_targets == flat_targets
    per_run = {}
    for key, run_index in zip(tree_targets, tp.target_run.tolist()):
        assert key not in per_run.setdefault(run_index, set())
        per_run[run_index].add(key)
    for run_index, rid in enumerate(tp.run_ids):
        run = next(r for r in runs if r.run_id == rid)
        kept = [t for t in tree.trajectories if t.run_id == rid]
        assert per_run.get(run_index, set()) == generated_prefixes(run) & kept_prefixes(kept)
    assert tp.num_targets == tree.stats.trainable_tokens
    for name in ("behaviour_logprobs", "policy_versions", "advantages", "loss_scale"):
        assert getattr(tp, name).tolist() == getattr(fp, name).tolist()
    assert abs(float(tp.loss_scale.double().sum()) - (1.0 if tp.num_targets else 0.0)) < 1e-4


def _root_path(node):
    parts = []
    while node is not None and node.tokens.size:
        parts.append([int(t) for t in node.tokens])
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def test_oracle_prefixes_sanity():
    assert prefixes([1, 2]) == {(1,), (1, 2)}
