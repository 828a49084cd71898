"""Engine actors (``EngineLayout.placement='actors'``, ``cells/engine_actors.py``): the placement
knob, where engines go (pure) and what ``cell_actors`` makes of it.

The Ray tests of engine actors share ``tests/cells/test_broadcast.py``'s pool (2 cells × 2
engine actors on logical GPUs; one pool saves CI time): each actor holds its own GPU (distinct
``ray.get_gpu_ids()``, its own ``CUDA_VISIBLE_DEVICES``), runs stay pinned to one actor and both
are used, a cell with live runs does not leave rollout, weights pushed by broadcast and by the
object store arrive bitwise in every actor's engine, and a killed runner takes its engine
actors with it while the job loses nothing."""

from __future__ import annotations

import pytest

from ray_xlong.cells.engine_actors import engine_bundles
from ray_xlong.cells.cell_engines import CellEngines, replicated_engine_set
from ray_xlong.cells.engines import EngineLayout, EngineLayoutError

ACTORS = EngineLayout(engines_per_cell=2, placement="actors")


@pytest.mark.parametrize("engines,tp,nodes,gpus,want", [
    pytest.param(2, 1, 1, 2, [0, 0], id="2-engines-one-bundle"),
    # 4 engines of tp 2 on 2 nodes × 4 GPUs: two per node
    pytest.param(4, 2, 2, 4, [0, 0, 1, 1], id="tp2-over-2-nodes"),
    # 2 engines on 4 nodes × 8 GPUs: a share of 16 GPUs each, engine 1 starts on bundle 2
    pytest.param(2, 8, 4, 8, [0, 2], id="spread-over-the-cell"),
    pytest.param(2, 1, 2, 0, [0, 1], id="cpu-cell-over-bundles"),
])
def test_engine_bundles(engines, tp, nodes, gpus, want):
    layout = EngineLayout(engines_per_cell=engines, tensor_parallel_size=tp)
    assert engine_bundles(layout, nodes_per_cell=nodes, gpus_per_node=gpus) == want


def test_placement_default_resolves_by_device_and_bad_values_name_the_field():
    assert EngineLayout().placement is None
    assert EngineLayout().resolve("cuda").placement == "actors"
    assert EngineLayout().resolve("cpu").placement == "process"
    assert ACTORS.resolve("cpu").placement == "actors"                  # an explicit choice stays
    with pytest.raises(EngineLayoutError, match="EngineLayout.placement must be one of"):
        EngineLayout(placement="gpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ray_xlong.models import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("ea") / "m", seed=0))


@pytest.mark.parametrize("sharding,placement,runner_gpus", [
    pytest.param(None, "process", True, id="cpu-cell-in-process"),
    pytest.param("cuda", "actors", False, id="cuda-cell-engine-actors"),
])
def test_cell_actors_decide_the_placement(model_dir, sharding, placement, runner_gpus):
    """``cell_actors`` resolves a ``CellEngines`` factory's placement for the cell's device;
    with engine actors the runner holds no GPU (``CellActors.engine_actors``)."""
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.rllib.cell_actors import cell_actors
    from ray_xlong.rllib.env_runner import RolloutConfig

    rollout = RolloutConfig(model_dir=model_dir, engine_factory=replicated_engine_set(
        EngineLayout(engines_per_cell=2), dict))
    actors = cell_actors(rollout=rollout, learner=LearnerSettings(model_dir=model_dir),
                         sharding=sharding and ShardingSettings(device=sharding))
    factory = actors.runner_kwargs["rollout_config"].engine_factory
    assert isinstance(factory, CellEngines) and factory.layout.placement == placement
    assert actors.engines == factory.layout and actors.engine_actors is not runner_gpus
