"""The runtime's contracts (``cells/protocols.py``) are kept by every implementation: both
Learners (``XLongLearner``, ``LearnerRank``; a ``ShardedCell`` fans every Learner call out to
its ranks), the runner and its fake, both engine hostings, the pool and its fake, the actuator's
actions, and the Ray edge and its fake. Checked by name and parameters, without Ray running."""

from __future__ import annotations

import pytest

from fakes import FakeLearner, FakePool, FakeRay, FakeRunner, Ledger
from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.engine_actors import EngineActors
from ray_xlong.cells.engines import EngineSet
from ray_xlong.cells.pool import CellPool
from ray_xlong.cells.protocols import (CellHost, EngineHosting, JobActions, Learner, Runner,
                                       conformance, members)
from ray_xlong.cells.ray_edge import RayCalls, RayEdge
from ray_xlong.cells.sharded import LearnerRank
from ray_xlong.cells.sharded_cell import ShardedCell


@pytest.mark.parametrize("impl, protocol", [
    pytest.param(LearnerRank, Learner, id="LearnerRank"),
    pytest.param(FakeLearner, Learner, id="FakeLearner"),
    pytest.param(FakeRunner, Runner, id="FakeRunner"),
    pytest.param(EngineSet, EngineHosting, id="EngineSet"),
    pytest.param(EngineActors, EngineHosting, id="EngineActors"),
    pytest.param(CellPool, CellHost, id="CellPool"),
    pytest.param(RayActuator, JobActions, id="RayActuator"),
    pytest.param(RayEdge, RayCalls, id="RayEdge"),
    pytest.param(FakeRay, RayCalls, id="FakeRay"),
])
def test_implementation_keeps_its_contract(impl, protocol):
    assert conformance(impl, protocol) == []


def test_the_fake_pool_keeps_the_cell_host_contract(tmp_path):
    pool = FakePool(2, spool_dir=str(tmp_path), ledger=Ledger(), ray=FakeRay())
    assert conformance(pool, CellHost) == []


def test_a_sharded_cell_fans_out_every_learner_call():
    cell = ShardedCell(ranks=[])
    assert conformance(ShardedCell, Learner) == []
    assert all(getattr(cell, name).name == name for name in members(Learner))


def test_conformance_names_what_is_missing_or_different():
    class Half:
        def start_runs(self, specs):       # no trailing ``after`` refs
            return []

    problems = conformance(Half, Runner)
    assert "Half.drain: missing" in problems
    assert any(p.startswith("Half.start_runs(specs)") for p in problems)


@pytest.mark.rllib
def test_the_rllib_actors_keep_their_contracts():
    from ray_xlong.rllib.cell_actors import CellRunner
    from ray_xlong.rllib.learner import XLongLearner

    assert conformance(XLongLearner, Learner) == []
    assert conformance(CellRunner, Runner) == []


def test_a_class_made_a_ray_actor_keeps_its_contract():
    """``ray.remote(cls)`` (no cluster needed) rewrites the signatures of the class's own
    functions with Ray's tracing keyword; the contract check looks through it (a full test run
    makes LearnerRank and XLongLearner actors before this module runs)."""
    ray = pytest.importorskip("ray")

    ray.remote(FakeLearner)
    assert "_ray_trace_ctx" in str(__import__("inspect").signature(FakeLearner.sleep))
    assert conformance(FakeLearner, Learner) == []
