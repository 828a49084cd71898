"""Elastic learner group: membership does not change the math (docs/design.md invariant 7).

Two steps of one fixed job (4 groups of synthetic runs per step) are trained by 1 cell, by 3
cells round-robin, and by cells joining at different micro-batches (with the batch streamed in
two chunks, as a step takes groups while they end). Every schedule must give the weights of a
plain-torch reference (whole batch at once, ``policy_loss``, Adam) — fp32 within 1e-5 of the
update 1e-4 (weights 1e-5), fp64 within 1e-12. Step 2 is trained by cells that sat out step 1, so it also checks
that a joining cell starts from the step's weights *and* optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import tempfile

import pytest
import torch

from ray_xlong.models import build_tiny_model_dir, load_model
from ray_xlong.models.tiny import full_precision_norms
from ray_xlong.cells.learner_group import ElasticLearnerGroup, plan_step
from ray_xlong.rllib.episodes import run_to_episode
from ray_xlong.rllib.learner import DTYPES, LearnerSettings, XLongLearner, learner_config
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.per_run import normalizer, pack_runs, process_run
from ray_xlong.trajectory.loss import policy_loss
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

pytestmark = [pytest.mark.ray, pytest.mark.rllib]

PROC = ProcessorConfig(row_tokens=256)
MICRO_TOKENS = 300                       # a step's batch splits into ~6 micro-batches
LR = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("lg") / "m", seed=0))


@pytest.fixture(scope="module")
def ray_local():
    import os

    import ray

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def step_runs(step: int):
    """4 groups × 3 runs of small synthetic runs; token ids < 64 fit the tiny vocabulary."""
    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=120, failed_prob=0.0)
    return synthetic_runs(100 + step, groups=4, runs_per_group=3, config=cfg,
                          policy_version=step)


def reference_weights(model_dir: str, dtype: str) -> dict[str, torch.Tensor]:
    """Plain torch: each step's batch processed at once, one loss, Adam — no Ray, no RLlib.

    The loss scale is the exact ``1 / num_targets`` in float64 (the packed batch stores it in
    float32, whose rounding alone would be ~6e-8 relative). Computed once per model and dtype
    in a test process (every schedule here and in ``test_sharded`` compares to it); each call
    gets its own copy."""
    return {k: v.clone() for k, v in _reference_weights(model_dir, dtype).items()}


@functools.cache
def _reference_weights(model_dir: str, dtype: str) -> dict[str, torch.Tensor]:
    model = load_model(model_dir, dtype=DTYPES[dtype]).train()
    if dtype == "float64":
        full_precision_norms(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(2):
        packed = TrajectoryProcessor(PROC).process(step_runs(step)).packed
        exact = torch.full_like(packed.loss_scale, 1.0, dtype=torch.float64) / packed.num_targets
        packed = dataclasses.replace(packed, loss_scale=exact)
        opt.zero_grad()
        policy_loss(token_logprobs(model, packed), packed)[0].backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plan(ray, runs):
    """What the actuator hands the group: micro-batches planned from digests, and one payload
    ref holding the runs' episodes (processed as a rollout cell does, where they ended)."""
    processed = [process_run(r, PROC) for r in runs]
    payload = ray.put([run_to_episode(r, processed=p) for r, p in zip(runs, processed)])
    micro, _ = plan_step([p.digest for p in processed], processor=PROC, max_tokens=MICRO_TOKENS)
    return micro, [payload]


def start_learners(ray, model_dir: str, dtype: str, n: int, *, cpus: float = 0.25):
    settings = LearnerSettings(model_dir=model_dir, lr=LR, dtype=dtype)
    config, spec = learner_config(settings, processor=PROC)
    actors = [ray.remote(XLongLearner).options(num_cpus=cpus).remote(config=config,
                                                                      module_spec=spec)
              for _ in range(n)]
    ray.get([a.build.remote() for a in actors])
    return actors


def train(ray, group: ElasticLearnerGroup, schedule, *, chunks: int) -> None:
    """Two steps. ``schedule[step]`` maps micro-batch index -> cell; a cell joins the step
    right before its first micro-batch."""
    for step in range(2):
        runs = step_runs(step)
        per = len(runs) // chunks
        parts = [plan(ray, runs[i * per:(i + 1) * per]) for i in range(chunks)]
        group.begin(step)
        refs, i = [], 0
        for part, payloads in parts:
            for micro in part:
                cell = schedule[step](i)
                if cell not in group.members:
                    group.join(cell)
                refs.append(group.submit(cell, micro, payloads=payloads))
                i += 1
        ray.get(refs)
        group.finish()


def errors(got: dict, want: dict, start: dict) -> tuple[float, float]:
    """(max over tensors of ‖got − want‖ / ‖want‖, the same for the update Δ = w − w_start).

    The update error is the stricter one: Adam divides by √v, so float noise in a tiny gradient
    entry moves its update by a visible fraction, while weights barely move."""
    weight = max(float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want)
    update = max(float((got[k] - want[k]).norm() / (want[k] - start[k]).norm().clamp_min(1e-30))
                 for k in want)
    return weight, update


@pytest.fixture(scope="module")
def learner_pool(ray_local, model_dir):
    """Three learners per dtype, built once, reset to version 0 for every test."""
    pools = {}

    def get(dtype: str):
        if dtype not in pools:
            actors = start_learners(ray_local, model_dir, dtype, 3)
            pools[dtype] = (actors, ray_local.get(actors[0].get_xlong_state.remote()))
        actors, state = pools[dtype]
        ray_local.get([a.set_xlong_state.remote(state) for a in actors])
        return actors
    yield get
    for actors, _ in pools.values():
        for a in actors:
            ray_local.kill(a)


SCHEDULES = [
    pytest.param(1, [lambda i: 0, lambda i: 0], 1, id="one-cell"),
    pytest.param(3, [lambda i: i % 3, lambda i: (i + 1) % 3], 1, id="three-cells-round-robin"),
    # step 0: cell 0 alone, cell 1 joins at micro-batch 2, cell 2 at 4; two streamed chunks.
    # step 1: only cells 1 and 2 (cell 2 joins at micro-batch 3): both must load step-0 state.
    pytest.param(3, [lambda i: 0 if i < 2 else (1 if i < 4 else 2),
                     lambda i: 1 if i < 3 else 2], 2, id="cells-join-mid-step"),
]


TOLERANCES = [  # (weights, update): the issue asks fp32 <= 1e-5 rel on the new weights
    pytest.param("float32", 1e-5, 1e-4, id="fp32"),        # measured 2.9e-6 / 1.4e-5
    pytest.param("float64", 1e-12, 1e-12, id="fp64", marks=pytest.mark.slow),  # 5e-15 / 2e-14
]


@pytest.mark.parametrize("dtype,weight_tol,update_tol", TOLERANCES)
@pytest.mark.parametrize("n,schedule,chunks", SCHEDULES)
@pytest.mark.slow
def test_same_batch_same_weights_whoever_trains_it(ray_local, learner_pool, model_dir, dtype,
                                                   weight_tol, update_tol, n, schedule, chunks):
    want = reference_weights(model_dir, dtype)
    start = {k: v.to(DTYPES[dtype]) for k, v in load_model(model_dir).state_dict().items()}
    learners = learner_pool(dtype)[:n]
    group = ElasticLearnerGroup(learners)
    train(ray_local, group, schedule, chunks=chunks)
    assert group.version == 2
    for learner in learners if n == 1 else learners[1:]:  # every cell of step 2
        weight_err, update_err = errors(ray_local.get(learner.get_weights.remote()), want,
                                        start)
        print(f"{dtype} n={n} chunks={chunks}: weights {weight_err:.2e}, "
              f"update {update_err:.2e}")
        assert weight_err <= weight_tol and update_err <= update_tol


def test_planned_weights_add_up_to_the_batch_normalizer():
    runs = step_runs(0)
    whole = TrajectoryProcessor(PROC).process(runs)
    processed = {r.run_id: process_run(r, PROC) for r in runs}
    parts = [plan_step([processed[r.run_id].digest for r in runs[i:i + 6]], processor=PROC,
                       max_tokens=MICRO_TOKENS)[0] for i in (0, 6)]
    micro = [m for p in parts for m in p]
    assert sum(m.weight for m in micro) == whole.packed.num_targets
    assert sum(m.targets for m in micro) == whole.packed.num_targets
    for m in micro:                                          # un-normalised, exactly 1 each
        packed = pack_runs([processed[r] for r in m.run_ids],
                           dict(zip(m.run_ids, m.advantages)), config=PROC)
        assert torch.equal(packed.loss_scale, torch.ones_like(packed.loss_scale))
        assert m.advantages == tuple(whole.advantages[r] for r in m.run_ids)  # whole groups
    assert list(itertools.chain(*(m.run_ids for m in micro))) == [r.run_id for r in runs]
    assert normalizer([], "run") == 1.0 and normalizer([], "token") == 1.0


@pytest.mark.slow
def test_a_learner_lost_mid_step_or_in_the_reduce_gives_the_same_update(ray_local, learner_pool,
                                                                        model_dir):
    """Issue 7: a learner that dies mid-step (step 0: between micro-batches) or inside the
    reduce (step 1: after every micro-batch was trained) is replaced; the micro-batches it held
    are trained again by others and both steps end on the reference weights, as if nothing
    happened. One group of 3 learners (the module's pool) meets both losses; the replacements
    take the dead ones' places in the pool."""
    from ray_xlong.cells.learner_group import StepIncomplete

    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    learners = learner_pool("float32")
    group = ElasticLearnerGroup(learners, ray=short_edge())
    replaced, fallbacks = [], []

    def replace(cell: int) -> list:
        # No CPU reservation: the module's learner pools already hold most of the 2 logical
        # CPUs, and a replacement that cannot be placed would wait forever.
        (new,) = start_learners(ray_local, model_dir, "float32", 1, cpus=0)
        ray_local.get(new.set_xlong_state.remote(group.state_ref))
        replaced.append(cell)
        return [(m, True) for m in group.replace(cell, new)]

    for step in range(2):
        micro, payloads = plan(ray_local, step_runs(step))
        group.begin(step)
        ray_local.get([group.join(c) for c in range(3)])
        queue, i = [(m, False) for m in micro], 0
        while queue:
            cell = sorted(group.members)[i % len(group.members)]
            m, counted = queue.pop(0)
            if step == 0 and i == len(micro) // 2:
                ray_local.kill(learners[1], no_restart=True)
            try:
                ray_local.get(group.submit(cell, m, payloads=payloads, counted=counted))
            except ray_local.exceptions.RayActorError:
                queue += replace(cell)               # includes the micro-batch that failed
                ray_local.get(group.join(cell))      # back in the step, on the step's state
            i += 1
        if step == 1:
            ray_local.kill(learners[2], no_restart=True)
        while True:
            try:
                group.finish()
                break
            except StepIncomplete as inc:
                assert step == 1 and inc.lost == [2] and inc.redo
                for c in inc.lost:
                    replace(c)
                for j, m in enumerate(inc.redo):     # the survivors train the lost work
                    cell = sorted(group.members)[j % len(group.members)]
                    ray_local.get(group.submit(cell, m, payloads=payloads, counted=True))
        fallbacks.append(group.fallbacks)
    learners[:] = group.learners          # the pool's learners: the replacements live on
    assert replaced == [1, 2] and group.version == 2
    # a member lost mid-step is replaced before the reduce (step 0 all-reduced as usual); the
    # dead member fails the all-reduce for everyone (step 1 went by the object store)
    assert fallbacks == [0, 1]
    weight_err, update_err = errors(ray_local.get(group.learners[0].get_weights.remote()), want,
                                    start)
    assert weight_err <= 1e-5 and update_err <= 1e-4


def short_edge(timeout_s: float = 5.0, peers=None):
    """A ``RayEdge`` whose collectives between cells give up after ``timeout_s`` (a lost
    member costs a test seconds, not the default minute); ``peers``: its rendezvous."""
    from ray_xlong.cells.ray_edge import RayEdge

    edge = RayEdge()
    edge.collective_timeout_s = timeout_s
    if peers is not None:
        edge._peer_groups = peers
    return edge


class PhantomMember:
    """``collectives.PeerGroups`` whose first ``fail`` reduce groups count one member more
    than the step has: the members wait for it until their timeout, as for a member lost
    mid-reduce, and every one of them must fall back with its gradient untouched."""

    def __init__(self, fail: int, timeout_s: float = 3.0) -> None:
        from ray_xlong.cells.collectives import PeerGroups

        self.peers = PeerGroups(timeout_s=timeout_s)
        self.fail = fail

    def groups(self, kind, cells):
        if kind != "reduce" or self.fail == 0:
            return self.peers.groups(kind, cells)
        self.fail -= 1
        out = self.peers.groups(kind, (*cells, 99))
        return {c: g for c, g in out.items() if c != 99}

    def failed(self, kind, cells):
        self.peers.failed(kind, cells)


# step 0: cell 0 alone; step 1: cells 1 and 2, which sat out step 0: each loads the step-0
# weights and Adam state from cell 0 (idle, asleep-equivalent) peer to peer.
SAT_OUT = [lambda i: 0, lambda i: 1 if i % 2 else 2]


@pytest.mark.slow
def test_cells_that_sat_out_load_the_state_peer_to_peer(ray_local, learner_pool, model_dir):
    """Item 1 of issue 22: the state of a step lives on its members; a joiner gets it from a
    holder by a broadcast between them (no state ref is ever made), and the collective
    reduction of the joiners gives the plain-torch weights."""
    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    learners = learner_pool("float32")
    before = ray_local.get(learners[0].traffic.remote())   # the pool's learners ran before
    group = ElasticLearnerGroup(learners, ray=short_edge())
    train(ray_local, group, SAT_OUT, chunks=1)
    assert group.version == 2 and group.peer_states == 2 and group.fallbacks == 0
    assert group.holders() == [1, 2]
    assert group.kept[0] == 1       # step 0 had one member: it left a copy in its object store
    for learner in learners[1:]:
        weight_err, update_err = errors(ray_local.get(learner.get_weights.remote()), want,
                                        start)
        assert weight_err <= 1e-5 and update_err <= 1e-4
    after = ray_local.get(learners[0].traffic.remote())
    sent = {k: n - before.get(k, 0) for k, n in after.items()}
    assert sent["state_out"] > 0 and not sent.get("gradients_out")   # no object-store reduce


@pytest.mark.slow
def test_a_failed_all_reduce_falls_back_to_the_object_store_with_the_same_update(
        ray_local, learner_pool, model_dir):
    """Step 0's all-reduce waits for a member that never comes (as one lost mid-reduce):
    every member's collective times out with its gradient untouched, the step goes through
    the object store, and step 1 makes a new group; both end on the plain-torch weights."""
    want = reference_weights(model_dir, "float32")
    start = {k: v.float() for k, v in load_model(model_dir).state_dict().items()}
    learners = learner_pool("float32")
    phantom = PhantomMember(fail=1)
    group = ElasticLearnerGroup(learners, ray=short_edge(peers=phantom))
    train(ray_local, group, [lambda i: i % 3, lambda i: (i + 1) % 3], chunks=1)
    assert group.version == 2 and group.fallbacks == 1 and phantom.peers.failures == 1
    for learner in learners:
        weight_err, update_err = errors(ray_local.get(learner.get_weights.remote()), want,
                                        start)
        assert weight_err <= 1e-5 and update_err <= 1e-4


def test_no_holder_left_asks_the_state_source_or_names_the_checkpoint():
    """Every learner holding the version is gone: ``state_ref`` asks the group's
    ``state_source``; the default one fails naming the checkpoint directory."""
    from fakes import FakeActor, FakeLearner, FakeRay, Ledger

    actors = [FakeActor(FakeLearner(Ledger()), "learner") for _ in range(2)]
    group = ElasticLearnerGroup(actors, ray=FakeRay())
    assert group.ray.get(group.state_ref)["version"] == 0      # a live holder's
    for a in actors:
        a.kill()
    with pytest.raises(RuntimeError, match="version 0 .*lost.*checkpoint"):
        group.state_ref
    from_disk = {"weights": {"w": 1.0}, "version": 0, "optimizer": None}
    group = ElasticLearnerGroup(actors, ray=FakeRay(), state_source=lambda v: from_disk)
    assert group.ray.get(group.state_ref) == from_disk
    assert group.ray.get(group.weights_ref) == from_disk["weights"]
