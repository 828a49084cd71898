"""Sharded cells (FSDP2, gloo on CPU): 2-rank cells train the plain-torch weights, and the
elastic membership invariance holds across multi-rank cells (DESIGN.md invariant 7).

The schedules and the reference are those of ``test_learner_group`` (two steps, 4 groups each,
~6 micro-batches per step): one 2-rank cell alone, and two 2-rank cells where cell 1 joins at
micro-batch 2 of step 0 and step 1 is trained by cell 1 alone after the streamed chunks.

The cells are started once per module and reset to version 0 by each test that trains them
(``set_xlong_state`` of the fresh state: the weights loaded, a fresh Adam): two context-parallel
cells (``cp_cells``) and three with rows over ranks (``row_cells``: two for the reduce, hand-over
and checkpoint test, one with a user's connector piece, which also loads the checkpoint).
"""

from __future__ import annotations

import pytest
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2

from ray_xlong.cells.config import LearnerSettings
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.cells.sharded import rank_rows
from ray_xlong.cells.sharded_cell import start_sharded_cell
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.models import load_model
from ray_xlong.rllib.connector import ADVANTAGES_KEY
from ray_xlong.rllib.episodes import processed_runs
from ray_xlong.rllib.learner import ConnectorBatches, learner_config
from ray_xlong.trajectory import TrajectoryProcessor
import tests.cells.test_learner_group as lg
from tests.cells.test_learner_group import (LR, PROC, errors, model_dir, plan,  # noqa: F401
                                            ray_local, reference_weights, step_runs, train)

WIDE_MICRO_TOKENS = 1500   # 2-4 rows per micro-batch: both ranks of a cell get rows

pytestmark = [pytest.mark.ray]


def pipeline(settings: LearnerSettings, user=None) -> ConnectorBatches:
    """The Learner connector pipeline a rank runs (the single Learner's: ``user``'s pieces,
    then PrefixTreeConnector)."""
    config, _ = learner_config(settings, processor=PROC, learner_connector=user)
    return ConnectorBatches(config)


def start_cells(model_dir: str, n: int, *, ranks: int = 2, user=None, cp: int = 1,
                timeout_s: float = 120.0, build: bool = True) -> list:
    """``n`` cells of ``ranks`` ranks; built (every rank set up) unless not ``build``."""
    settings = LearnerSettings(model_dir=model_dir, lr=LR, dtype="float32", context_parallel=cp)
    sharding = ShardingSettings(ranks_per_cell=ranks, timeout_s=timeout_s)
    import ray

    cells = [start_sharded_cell(pg=None, settings=settings, sharding=sharding,
                                nodes_per_cell=1, gpus_per_node=0,
                                batch_of=pipeline(settings, user)) for _ in range(n)]
    if build:
        ray.get([c.build.remote() for c in cells])
    return cells


def reset(ray, cells: list, fresh: dict) -> None:
    """Every cell back to version 0: the loaded weights, a fresh Adam (``fresh``: a cell's
    ``get_xlong_state`` before its first step)."""
    ray.get([c.set_xlong_state.remote(fresh) for c in cells])


@pytest.fixture(scope="module")
def cp_cells(ray_local, model_dir):
    """``cp_cells()``: two 2-rank context-parallel cells, started on first use, and their fresh
    state; ``cp_cells.free()`` stops them (the last test of them, which leaves them behind
    replaced). A rank's collectives give up after 15 s: the survivors of a cell that lost a
    rank wait no longer than that."""
    held: dict = {}

    def get() -> tuple[list, dict]:
        if not held:
            cells = start_cells(model_dir, 2, cp=2, timeout_s=15)
            held.update(cells=cells, fresh=ray_local.get(cells[0].get_xlong_state.remote()))
        return held["cells"], held["fresh"]

    def free() -> None:
        for c in held.get("cells", ()):
            c.kill()
        held.clear()

    get.free = free
    yield get
    free()


@pytest.fixture(scope="module")
def row_cells(ray_local, model_dir):
    """Three 2-rank cells, rows over ranks (context_parallel 1), started together: two with
    the single Learner's pipeline and one whose pipeline runs a user's piece first (it doubles
    every run's advantage before packing); and their fresh state."""

    def user_pieces(obs, act):   # local: pickled by value into the ranks, with its class

        class DoubleAdvantages(ConnectorV2):
            """A user's learner connector piece: doubles every run's advantage."""

            def __call__(self, *, rl_module, batch, episodes, shared_data=None, **kwargs):
                advantages = shared_data[ADVANTAGES_KEY]
                for run_id in advantages:
                    advantages[run_id] *= 2.0
                return batch

        return [DoubleAdvantages()]

    cells = start_cells(model_dir, 2, build=False)
    (user,) = start_cells(model_dir, 1, user=user_pieces, build=False)
    ray_local.get([c.build.remote() for c in (*cells, user)])
    fresh = ray_local.get(cells[0].get_xlong_state.remote())
    yield cells, user, fresh
    for c in (*cells, user):
        c.kill()


JOIN_SCHEDULE = [lambda i: 0 if i < 2 else 1, lambda i: 1]
"""Step 0: cell 0 alone, cell 1 joins at micro-batch 2; step 1: cell 1 alone (it must hold the
step-0 weights and Adam state), two streamed chunks per step. A 2-rank cell training a step
alone (step 1) is part of it: no schedule of one cell on its own. The cells are
context-parallel (``LearnerSettings.context_parallel`` 2: every row split over both ranks);
rows over ranks (cp 1) train the plain-torch weights in
``test_sharded_cells_reduce_and_hand_over_state_shard_to_shard``."""


@pytest.mark.slow
def test_sharded_cells_train_the_plain_torch_weights(ray_local, cp_cells, model_dir,
                                                     monkeypatch):
    monkeypatch.setattr(lg, "MICRO_TOKENS", WIDE_MICRO_TOKENS)
    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    cells, fresh = cp_cells()
    reset(ray_local, cells, fresh)
    group = ElasticLearnerGroup(cells)
    train(ray_local, group, JOIN_SCHEDULE, chunks=2)
    assert group.version == 2
    got = ray_local.get(cells[-1].get_weights.remote())
    weight_err, update_err = errors(got, want, start)
    rank1 = ray_local.get(cells[0].ranks[1].xlong_metrics.remote())
    print(f"sharded: weights {weight_err:.2e}, update {update_err:.2e}; "
          f"rank 1 of cell 0 trained {rank1['tokens']} targets")
    assert rank1["tokens"] > 0            # the cell's second rank trained rows of its own
    assert weight_err <= 1e-5 and update_err <= 1e-4


def test_rank_rows_cover_every_row_once_and_pad_an_idle_rank():
    packed = TrajectoryProcessor(PROC).process(step_runs(0)).packed
    rows = int(packed.input_ids.shape[0])
    parts = [rank_rows(packed, rank=r, world_size=2) for r in range(2)]
    assert sum(p.input_ids.shape[0] for p, _ in parts) == rows
    assert sum(t for _, t in parts) == packed.num_targets
    idle, targets = rank_rows(packed, rank=rows, world_size=rows + 1)
    assert targets == 0 and idle.input_ids.shape[0] == 1
    assert torch.count_nonzero(idle.loss_scale) == 0


@pytest.mark.slow
def test_a_rank_lost_mid_step_redoes_the_cells_share(ray_local, cp_cells, model_dir,
                                                     monkeypatch):
    """Rank 1 of cell 1 dies between micro-batches: the cell's next call fails as an actor loss
    (``actor_lost``), a new 2-rank cell takes its place, the micro-batches the dead cell held go
    to the queue again, and both steps end on the plain-torch weights. Context-parallel cells
    (the partition of rows over ranks is exact on its own above; a rank lost inside a sharded
    job's step with rows over ranks: tests/tools/test_faults.py)."""
    from ray_xlong.cells.learner_group import actor_lost

    monkeypatch.setattr(lg, "MICRO_TOKENS", WIDE_MICRO_TOKENS)

    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    cells, fresh = cp_cells()
    reset(ray_local, cells, fresh)
    group = ElasticLearnerGroup(list(cells))
    lost = []
    try:
        for step in range(2):
            micro, payloads = plan(ray_local, step_runs(step))
            group.begin(step)
            ray_local.get([group.join(c) for c in range(2)])
            queue, i = [(m, False) for m in micro], 0
            while queue:
                cell = sorted(group.members)[i % len(group.members)]
                m, counted = queue.pop(0)
                if step == 0 and i == 2:
                    ray_local.kill(group.learners[1].ranks[1], no_restart=True)
                try:
                    ray_local.get(group.submit(cell, m, payloads=payloads, counted=counted))
                except ray_local.exceptions.RayError as exc:
                    assert actor_lost(exc) or "rank" in str(exc).lower() or cell == 1
                    group.learners[cell].kill()
                    (replacement,) = start_cells(model_dir, 1, cp=2, timeout_s=15)
                    ray_local.get(replacement.set_xlong_state.remote(group.state_ref))
                    queue += [(x, True) for x in group.replace(cell, replacement)]
                    ray_local.get(group.join(cell))
                    lost.append(cell)
                i += 1
            group.finish()
        got = ray_local.get(group.learners[1].get_weights.remote())
    finally:
        cells[:] = group.learners        # the replacement too: no later test needs them
        cp_cells.free()
    assert lost == [1] and group.version == 2
    weight_err, update_err = errors(got, want, start)
    print(f"rank lost: weights {weight_err:.2e}, update {update_err:.2e}")
    assert weight_err <= 1e-5 and update_err <= 1e-4


def test_a_rank_reads_its_runs_processed_where_they_ended_or_processes_them():
    """``processed_runs`` keeps the carried ``ProcessedRun``, processes a run that carries none,
    skips unwanted runs; a rank without a pipeline, or whose payloads lack a run, says so
    before training."""
    from ray_xlong.cells.sharded import LearnerRank
    from ray_xlong.rllib.episodes import run_to_episode
    from ray_xlong.trajectory.per_run import process_run

    runs = step_runs(0)[:3]
    carried = process_run(runs[0], PROC)
    episodes = [run_to_episode(runs[0], processed=carried)] + [run_to_episode(r) for r in runs[1:]]
    got = processed_runs(episodes, wanted=[runs[0].run_id, runs[1].run_id], config=PROC)
    assert set(got) == {runs[0].run_id, runs[1].run_id} and got[runs[0].run_id] is carried
    assert got[runs[1].run_id].digest == process_run(runs[1], PROC).digest
    settings = LearnerSettings(model_dir="unused", lr=LR, dtype="float32")
    sharding = ShardingSettings(ranks_per_cell=2)
    bare = LearnerRank(settings=settings, sharding=sharding, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="batch_of"):
        bare.accumulate_runs([runs[0].run_id], [1.0], 0, episodes)
    rank = LearnerRank(settings=settings, sharding=sharding, rank=0, world_size=2,
                       batch_of=pipeline(settings))
    with pytest.raises(ValueError, match="lack runs"):
        rank.accumulate_runs(["nope"], [1.0], 0, episodes)


@pytest.mark.slow
def test_a_users_connector_piece_runs_on_a_sharded_rank(ray_local, row_cells, model_dir):
    """The user's piece (``row_cells``' third cell) runs on both ranks of a 2-rank cell before
    PrefixTreeConnector: the cell's gradient of one micro-batch is twice plain torch's on the
    same runs (the loss is linear in positive advantage scales, PPO clip and truncated IS
    alike)."""
    from ray_xlong.trajectory.accumulate import accumulate_loss
    from ray_xlong.trajectory.per_run import pack_runs, process_run

    runs = step_runs(0)
    micro, payloads = plan(ray_local, runs)
    m = micro[0]
    _, cell, fresh = row_cells
    reset(ray_local, [cell], fresh)
    ray_local.get(cell.accumulate_runs.remote(m.run_ids, m.advantages, 0, *payloads))
    got = ray_local.get(cell.take_gradients.remote())
    by_id = {r.run_id: process_run(r, PROC) for r in runs}
    packed = pack_runs([by_id[r] for r in m.run_ids], dict(zip(m.run_ids, m.advantages)),
                       config=PROC)
    from ray_xlong.trajectory.tree_attention import ATTN_IMPLEMENTATION, register

    register()
    lm = load_model(model_dir, attn_implementation=ATTN_IMPLEMENTATION).train()
    accumulate_loss(lm, packed)
    for name, p in lm.named_parameters():
        want = 2.0 * p.grad
        err = float((got[name] - want).norm() / want.norm().clamp_min(1e-30))
        assert err <= 1e-5, (name, err)


@pytest.mark.slow
def test_sharded_cells_reduce_and_hand_over_state_shard_to_shard(ray_local, row_cells, model_dir,
                                                                 tmp_path, monkeypatch):
    """Issue 22, items 1 and 3: step 0 is cell 0's alone; cell 1 sat it out, joins step 1 at
    micro-batch 2 and gets the step-0 weights and Adam shards from cell 0 rank to rank; the
    step's all-reduce sums rank i's gradient shard with rank i of the other cell. Nothing is
    gathered (no ``take_gradients``), every rank moves about its shard, each rank trains rows of
    its own (context_parallel 1), and both cells end on the plain-torch weights.

    Then the cell's own checkpoint and export: every rank of cell 0 writes its shards with
    ``dcp.async_save`` (over a gloo group of their own); another 2-rank cell, at version 0,
    loads them back to the same weights and Adam state bit for bit; the Hugging Face directory
    rank 0 writes (gathering one tensor at a time) and the one ``models.export`` reads from the
    shards in a plain process hold the cell's weights bit for bit and load in transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ray_xlong.models.export import export_checkpoint

    monkeypatch.setattr(lg, "MICRO_TOKENS", WIDE_MICRO_TOKENS)
    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    cells, other, fresh = row_cells
    reset(ray_local, [*cells, other], fresh)
    before = [ray_local.get(r.traffic.remote()) for c in cells for r in c.ranks]
    group = ElasticLearnerGroup(cells, ray=lg.short_edge(30.0))
    train(ray_local, group, [lambda i: 0, lambda i: 0 if i < 2 else 1], chunks=1)
    assert group.version == 2 and group.peer_states == 1 and group.fallbacks == 0
    after = [ray_local.get(r.traffic.remote()) for c in cells for r in c.ranks]
    traffic = [{k: n - b.get(k, 0) for k, n in a.items()} for a, b in zip(after, before)]
    model = sum(t.numel() * t.element_size() for t in start.values()
                if t.dtype.is_floating_point)
    for t in traffic:   # one all-reduce of a half-model shard over 2 cells: ~½ model
        assert not t.get("gradients_in") and not t.get("gradients_out")
        assert 0.3 * model <= t["reduce_in"] <= 0.7 * model
    assert traffic[1]["state_out"] == traffic[3]["state_in"] > 0   # cell 0 rank 1 → 1 / 1
    rank1 = ray_local.get(cells[0].ranks[1].xlong_metrics.remote())
    assert rank1["tokens"] > 0            # the cell's second rank trained rows of its own
    for cell in cells:
        weight_err, update_err = errors(ray_local.get(cell.get_weights.remote()), want,
                                        start)
        assert weight_err <= 1e-5 and update_err <= 1e-4

    a, b = cells[0], other
    path = str(tmp_path / "learner-v000002")
    ray_local.get(a.save_checkpoint.remote(path, {"records.bin": b"r"}, False))
    assert ray_local.get(a.wait_checkpoint.remote()) == path
    assert (tmp_path / "records.bin").read_bytes() == b"r"      # rank 0, once all wrote
    state = ray_local.get(a.get_xlong_state.remote())

    assert ray_local.get(b.xlong_metrics.remote())["version"] == 0
    assert ray_local.get(b.load_checkpoint.remote(path)) == 2
    got = ray_local.get(b.get_xlong_state.remote())
    assert got["version"] == 2
    assert all(torch.equal(state["weights"][k], got["weights"][k]) for k in state["weights"])
    sa, sb = state["optimizer"]["state"], got["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(
        torch.equal(sa[k][m], sb[k][m]) for k in sa for m in ("exp_avg", "exp_avg_sq"))

    out = tmp_path / "hf"
    ray_local.get(a.export_hf.remote(str(out)))
    exported = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(state["weights"][k], exported[k]) for k in state["weights"])
    from_shards = export_checkpoint(path, tmp_path / "hf2")
    x, y = (load_file(str(d / "model.safetensors")) for d in (out, from_shards))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
