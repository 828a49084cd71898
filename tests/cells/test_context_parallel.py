"""Context parallelism: a sharded cell's ranks split tree rows by token ranges (gloo, no Ray).

Two or four processes run ``LearnerRank`` itself (FSDP2 over all, ``context_parallel`` = the
processes: one data-parallel group, every row joined and split) and, next to it, the plain
model on the same rank share with each K/V exchange (``spans``, ``all``, ``ring``); the cell's
summed gradient, each exchange's summed gradient and the ranks' logprobs must equal one
device's (fp32: logprobs ≤ 1e-4 abs, gradients ≤ 1e-4 relative to each tensor's largest
entry).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_xlong.cells.config import CellJobConfig, LearnerSettings
from ray_xlong.cells.context_parallel import rank_share
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.models import TinyModelConfig, load_model, tiny_causal_lm
from ray_xlong.scheduling import SchedulingConfig
from ray_xlong.trajectory import LossConfig, ProcessorConfig, TrajectoryProcessor, policy_loss
from ray_xlong.trajectory.context_parallel import (EXCHANGES, ContextParallelError, join_rows,
                                                   shard_row)
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


def tree_batch():
    """Two runs' trees in two rows (rows are joined into one, then split)."""
    cfg = SyntheticConfig(num_calls=10, vocab_size=64, system_tokens=4, task_tokens=3,
                          tool_tokens_mean=3.0, output_tokens_mean=3.0, context_budget=45,
                          summary_tokens=3, num_subagents=1, subagent_calls=2, num_retries=2,
                          timeout_prob=0.3, failed_prob=0.0)
    runs = synthetic_runs(3, groups=1, runs_per_group=2, config=cfg)
    return TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=3, pack="tree",
                                               row_tokens=None)).process(runs).packed


def run_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from a fork server that imported this
    module (torch, transformers, the package) once per test process: a spawned rank imports
    them itself, ~8 s of CPU each. The server only imports (it never ran an OpenMP region), so
    forking it is safe, unlike forking this process."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    from ray_xlong.cells.sharded import LearnerRank

    torch.set_num_threads(1)
    settings = LearnerSettings(model_dir=model_dir, context_parallel=world)
    learner = LearnerRank(settings=settings, sharding=ShardingSettings(ranks_per_cell=world),
                          rank=rank, world_size=world)
    learner.setup("127.0.0.1", port)
    batch = tree_batch()
    learner.accumulate(batch.to_tensors())
    saved = {"grads": learner.take_gradients()}
    plain = load_model(model_dir, attn_implementation="xlong_tree")
    for exchange in EXCHANGES:                     # each exchange: logprobs, summed gradient
        local, plan, _ = rank_share(batch, rank=rank, world_size=world, context_parallel=world,
                                    group=learner.cp_group, exchange=exchange)
        plain.zero_grad()
        logprobs = token_logprobs(plain, local, plan=plan, chunk_tokens=5)
        policy_loss(logprobs, local, settings.loss)[0].backward()
        grads = {k: p.grad.clone() for k, p in plain.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=learner.cp_group)
        saved[exchange] = {"logprobs": logprobs.detach(), "grads": grads, "sizes": plan.sizes,
                           "src": local.target_src + plan.start, "ids": local.target_ids,
                           "rounds": [len(parts) for parts in plan.ring.rounds]
                           if plan.ring else None}
    if world == 4:      # the same 4 processes: context_parallel 2, a ring inside each pair
        saved["ring_in_pairs"] = _ring_in_pairs(rank, plain)
    torch.save(saved, f"{out}/rank{rank}.pt")


def _ring_in_pairs(rank: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On 4 ranks (the default group): context_parallel 2, each group's ring passes blocks
    among its own two ranks; returns the cell's gradient (summed over both groups)."""
    from ray_xlong.cells.context_parallel import make_groups

    group = make_groups(4, 2, rank)
    local, plan, _ = rank_share(tree_batch(), rank=rank, world_size=4, context_parallel=2,
                                group=group, exchange="ring")
    assert plan.ring.rounds and any(plan.ring.rounds[0]) == (rank % 2 == 1)
    model.zero_grad()
    logprobs = token_logprobs(model, local, plan=plan)
    policy_loss(logprobs, local, LossConfig())[0].backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)                         # over both groups: the cell's gradient
    return grads


# 4 forked ranks: ~27 s in CI's full run; the default suite keeps the 2-rank step
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_step_equals_one_device(tmp_path, world):
    # the cell's own step (LearnerRank, default exchange) and each exchange on the plain model;
    # on 4 ranks also context_parallel 2 in the same processes: the ring inside two groups of
    # two
    from ray_xlong.trajectory.tree_attention import register

    register()
    model = tiny_causal_lm(TinyModelConfig(vocab_size=64), attn_implementation="xlong_tree")
    model.save_pretrained(tmp_path / "model")
    batch = tree_batch()
    assert batch.input_ids.shape[0] == 2
    run_ranks(_rank, (world, str(tmp_path / "model"), free_port(), str(tmp_path)), world)

    model.train()
    want_lp = token_logprobs(model, batch, chunk_tokens=0)
    loss, _ = policy_loss(want_lp, batch, LossConfig())
    loss.backward()
    joined = join_rows(batch, [0, 1])
    want = {(int(s), int(t)): float(v) for s, t, v in
            zip(joined.target_src, joined.target_ids, token_logprobs(model, joined).detach())}
    parts = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for exchange in EXCHANGES:
        got = {}
        for part in parts:
            got.update({(int(s), int(t)): float(v) for s, t, v in
                        zip(part[exchange]["src"], part[exchange]["ids"],
                            part[exchange]["logprobs"])})
        assert got.keys() == want.keys() and len(got) == batch.num_targets > 50
        assert max(abs(got[k] - want[k]) for k in want) <= 1e-4, exchange
    sizes = {x: parts[0][x]["sizes"] for x in EXCHANGES}
    assert sum(sizes["all"]) == int(joined.valid.sum()) > sum(sizes["spans"]) > 0
    rounds = [part["ring"]["rounds"] for part in parts]
    # the ring is exercised: some rank attends a block that came more than one hop (4 ranks)
    assert max(len(r) for r in rounds) == world // 2 and rounds[-1][-1] > 0
    cell_grads = [parts[0]["grads"]] + [parts[0][x]["grads"] for x in EXCHANGES]
    if world == 4:      # 4 ranks, context_parallel 2: the ring inside two groups of two
        cell_grads.append(parts[3]["ring_in_pairs"])
    for grads in cell_grads:
        for name, p in model.named_parameters():
            scale = float(p.grad.abs().max())
            assert float((grads[name] - p.grad).abs().max()) <= 1e-4 * max(scale, 1e-12), name


def test_rows_split_by_token_ranges_cover_every_target_once():
    joined = join_rows(tree_batch(), [0, 1])
    n = int(joined.valid.sum())
    seen = []
    for rank in range(3):
        local, plan = shard_row(joined, rank=rank, size=3)
        assert plan.width == -(-n // 3) and local.input_ids.shape == (1, plan.width)
        assert int(local.valid.sum()) == min(plan.width, n - plan.start)
        seen += (local.target_src + plan.start).tolist()
    assert sorted(seen) == sorted(joined.target_src.tolist())


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("exchange", ["spans", "all"])
def test_each_ranks_context_sees_exactly_what_the_mask_allows(size, exchange):
    from ray_xlong.trajectory.model import tree_mask_bool

    joined = join_rows(tree_batch(), [0, 1])
    mask = tree_mask_bool(joined.attention_mask)[0, 0]
    for rank in range(size):
        _, plan = shard_row(joined, rank=rank, size=size, exchange=exchange)
        cols = plan.context_columns()
        queries = []
        for p in plan.pieces:
            for q in range(p.start, p.stop):
                seen = {cols[c] for lo, hi in p.prefix for c in range(lo, hi)}
                seen |= {cols[c] for c in range(p.start, q + 1)}
                assert seen == set(torch.nonzero(mask[cols[q]]).flatten().tolist())
                queries.append(cols[q])
        assert queries == list(range(plan.start, min(plan.start + plan.width,
                                                     int(joined.valid.sum()))))


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_each_ranks_ring_rounds_see_exactly_what_the_mask_allows(size):
    # round 0 (own columns) plus each visiting block's parts: every key the mask allows, once
    from ray_xlong.trajectory.model import tree_mask_bool

    joined = join_rows(tree_batch(), [0, 1])
    mask = tree_mask_bool(joined.attention_mask)[0, 0]
    n = int(joined.valid.sum())
    for rank in range(size):
        _, plan = shard_row(joined, rank=rank, size=size, exchange="ring")
        ring, start = plan.ring, plan.start
        seen = {q: [] for q in range(start, min(start + plan.width, n))}
        for p in ring.local:
            for q in range(p.start, p.stop):
                seen[q + start] += [c + start for lo, hi in p.prefix for c in range(lo, hi)]
                seen[q + start] += [c + start for c in range(p.start, q + 1)]
        for k, parts in enumerate(ring.rounds, start=1):
            owner = (rank - k) % size
            block = [c for lo, hi in plan.spans[owner] for c in range(lo, hi)]
            for p in parts:
                for q in range(p.start, p.stop):
                    seen[q + start] += [block[c] for lo, hi in p.ranges for c in range(lo, hi)]
        for q, keys in seen.items():
            assert sorted(keys) == torch.nonzero(mask[q]).flatten().tolist(), (rank, q)
        assert sum(hi - lo for lo, hi in ring.send) <= ring.block


def test_context_parallel_that_does_not_divide_the_ranks_names_both(tmp_path):
    with pytest.raises(ContextParallelError, match=r"context_parallel=3 does not divide the "
                                                   r"cell's 4 Learner ranks"):
        CellJobConfig(mode="elastic",
                      job=SchedulingConfig(total_steps=1, batch_groups=1, runs_per_group=2,
                                           staleness_bound=1),
                      layout=CellLayout(cells=2, nodes_per_cell=1, gpus_per_node=1),
                      learner=LearnerSettings(model_dir=str(tmp_path), context_parallel=3),
                      sharding=ShardingSettings(ranks_per_cell=4))
    with pytest.raises(ValueError, match="LearnerSettings.context_parallel"):
        LearnerSettings(model_dir=str(tmp_path), context_parallel=0)


@pytest.mark.parametrize("loss", [LossConfig(ratio_level="sequence"),
                                  LossConfig(ratio_level="geo_mean"),
                                  LossConfig(sequence_mask=(0.5, 2.0))])
def test_a_sequence_level_loss_under_context_parallelism_is_refused(tmp_path, loss):
    # each rank holds part of a run's targets: a run's ratio would be a rank's partial one
    with pytest.raises(ValueError, match=r"context_parallel=2 splits each run's targets.*"
                                         r"ratio_level="):
        LearnerSettings(model_dir=str(tmp_path), context_parallel=2, loss=loss)
    LearnerSettings(model_dir=str(tmp_path), context_parallel=1, loss=loss)   # one rank: fine


def test_context_parallel_larger_than_the_row_names_both():
    batch = tree_batch()
    small = join_rows(batch, [0])
    n = int(small.valid.sum())
    with pytest.raises(ContextParallelError, match=rf"context_parallel={n + 1} exceeds the row: "
                                                   rf"{n + 1} ranks for a row of {n} tokens"):
        shard_row(small, rank=0, size=n + 1)
