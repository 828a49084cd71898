"""A sharded cell's Learner rank while its cell serves (``LearnerRank.sleep`` / ``wake_up``),
without Ray: one rank of a 1-rank gloo world in this process. The device move is forced on
CPU by sending the state to the ``meta`` device: every parameter shard and every Adam moment
leaves the rank's device, the optimizer still holds the same parameter objects, and a rank
asleep refuses to train."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from ray_xlong.cells.config import LearnerSettings
from ray_xlong.cells.sharded import LearnerRank, move_training_state
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.packing import micro_batches
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from tests.cells.test_learner_group import model_dir  # noqa: F401 (fixture)


@pytest.fixture
def rank(model_dir):
    """A set-up 1-rank LearnerRank after one Adam step (Adam has moments)."""
    if dist.is_initialized():    # a group an earlier test in this worker process left behind
        dist.destroy_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = LearnerRank(settings=LearnerSettings(model_dir=str(model_dir), lr=1e-3),
                    sharding=ShardingSettings(), rank=0, world_size=1)
    r.setup("127.0.0.1", port)
    cfg = SyntheticConfig(num_calls=3, vocab_size=200, context_budget=60, failed_prob=0.0,
                          timeout_prob=0.0)
    packed = TrajectoryProcessor(ProcessorConfig(row_tokens=256)).process(
        synthetic_runs(0, groups=1, runs_per_group=1, config=cfg)).packed
    micro = micro_batches(packed, max_tokens=100_000)[0].to_tensors()
    targets = r.accumulate(micro)
    r.apply_step([r.take_gradients()], float(targets), 1)
    r.micro = micro
    yield r
    dist.destroy_process_group()


def _state_tensors(r: LearnerRank) -> list[torch.Tensor]:
    return [v for st in r.opt.state.values() for v in st.values()
            if torch.is_tensor(v) and v.dim() > 0]


def test_sleep_moves_every_parameter_shard_and_adam_moment_off_the_device(rank):
    params = list(rank.lm.parameters())
    held = [p for group in rank.opt.param_groups for p in group["params"]]
    assert _state_tensors(rank) and all(t.device.type == "cpu" for t in _state_tensors(rank))
    rank.offload_to = torch.device("meta")          # the CUDA path, forced: device != target
    rank.sleep()
    assert rank.asleep
    assert all(p.device.type == "meta" for p in rank.root.parameters())
    assert all(t.device.type == "meta" for t in _state_tensors(rank))
    assert list(rank.lm.parameters()) == params and held == params   # same objects
    assert rank.sleep_memory == {"before_sleep": 0, "asleep": 0}     # 0 off CUDA
    with pytest.raises(RuntimeError, match="asleep"):
        rank.accumulate(rank.micro, 1)


def test_move_training_state_moves_parameters_and_moments_not_adams_step(rank):
    """It reports exactly the parameter, buffer (rotary frequencies) and moment bytes, leaves
    Adam's scalar step counts where they are, and moves nothing the second time."""
    moments = _state_tensors(rank)
    steps = [st["step"] for st in rank.opt.state.values()]
    nbytes = sum(t.numel() * t.element_size()
                 for t in [*rank.root.parameters(), *rank.root.buffers(), *moments])
    assert move_training_state(rank.root, rank.opt, torch.device("meta")) == nbytes
    assert all(a is b for a, b in zip([st["step"] for st in rank.opt.state.values()], steps))
    assert move_training_state(rank.root, rank.opt, torch.device("meta")) == 0


def test_a_cpu_rank_sleeps_and_wakes_in_place_and_trains_on(rank):
    """On CPU the device is the host: nothing moves, the weights are untouched, and the
    woken rank takes the next step."""
    before = rank.get_weights()
    rank.sleep()
    assert rank.wake_up() == 1
    after = rank.get_weights()
    assert all(torch.equal(after[k], before[k]) for k in before)
    targets = rank.accumulate(rank.micro, 1)
    assert rank.apply_step([rank.take_gradients()], float(targets), 2) == 2
