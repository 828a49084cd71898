"""Several engines per rollout cell: layouts that do not divide the cell's GPUs are errors; an
``EngineSet`` of two real HF engines serves agent runs with each run on one engine, both
engines used, the cell empty after; a weight update reaches every engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ray_xlong.cells.cell_engines import engine_set_factory
from ray_xlong.cells.engines import EngineLayout, EngineLayoutError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ray_xlong.models import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("eng") / "m", seed=0))


@pytest.fixture(scope="module")
def chat(model_dir):
    from ray_xlong.rollout import load_chat_format

    return load_chat_format(model_dir)


@pytest.mark.parametrize("engines,tp,nodes,gpus,per", [
    pytest.param(8, 1, 1, 8, 1, id="8-engines-on-8-gpus"),
    pytest.param(2, 4, 1, 8, 4, id="2-engines-tp4"),
    pytest.param(4, 8, 4, 8, 8, id="4-nodes-one-tp8-engine-each"),
    pytest.param(2, 1, 2, 0, 0, id="cpu-cell"),
])
def test_layouts_that_fit(engines, tp, nodes, gpus, per):
    layout = EngineLayout(engines_per_cell=engines, tensor_parallel_size=tp)
    assert layout.check(nodes_per_cell=nodes, gpus_per_node=gpus) == per


@pytest.mark.parametrize("engines,tp,nodes,gpus,match", [
    pytest.param(3, 1, 1, 8, r"engines_per_cell=3 × tensor_parallel_size=1 = 3 GPUs does not "
                 r"divide the cell's 8 GPUs", id="3-on-8"),
    pytest.param(1, 16, 2, 8, r"tensor_parallel_size=16 spans nodes", id="tp-across-nodes"),
    pytest.param(1, 2, 1, 0, r"tensor_parallel_size=2 on a cell without GPUs", id="tp-on-cpu"),
])
def test_layouts_that_do_not_divide_are_errors(engines, tp, nodes, gpus, match):
    layout = EngineLayout(engines_per_cell=engines, tensor_parallel_size=tp)
    with pytest.raises(EngineLayoutError, match=match):
        layout.check(nodes_per_cell=nodes, gpus_per_node=gpus)


class Recording:
    """An engine that notes which run (asyncio task) called it."""

    def __init__(self, engine) -> None:
        self.engine, self.callers = engine, set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, input_ids, *, sampling):
        self.callers.add(id(asyncio.current_task()))
        return await self.engine.generate(input_ids, sampling=sampling)


def test_runs_stay_on_their_engine_and_weights_reach_every_engine(model_dir, chat):
    from ray_xlong.rollout import HarnessConfig, HFEngine, Harness
    from ray_xlong.rollout.tasks import make_task

    factory = engine_set_factory(EngineLayout(engines_per_cell=2),
                                 lambda i, tp: Recording(HFEngine(model_dir, seed=i)))

    async def main():
        engines = factory()
        harness = Harness(engines, chat, config=HarnessConfig(max_new_tokens=8, max_calls=3))
        results = await harness.run_many([make_task("arithmetic", seed=s) for s in range(4)],
                                         run_ids=[f"r{s}" for s in range(4)],
                                         group_ids=["g"] * 4)
        assert engines.live_runs == [0, 0] and engines.num_pending() == 0   # drained
        new = {k: v + 0.01 for k, v in engines.engines[0].engine.model.state_dict().items()}
        await engines.update_weights(new, version=1)
        return engines, results

    engines, results = asyncio.run(main())
    a, b = (e.callers for e in engines.engines)
    assert a and b and not a & b                  # both engines served; no run on both
    assert engines.runs_served == [2, 2]
    assert sum(len(r.run.calls) for r in results) == engines.stats().requests
    assert engines.policy_version == 1
    w0, w1 = (e.engine.model.state_dict() for e in engines.engines)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
