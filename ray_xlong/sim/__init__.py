"""Discrete-event simulator, workload and cost models, presets (pure: no ray, no vllm, no torch).

``simulate(policy, workload=..., cluster=..., costs=..., config=...)`` runs a scheduling policy
unchanged against a virtual clock and returns a :class:`SimResult` with the event log.

May import: ``scheduling`` (the policies it runs); no ray, vllm or torch.
"""

from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.metrics import ModeSummary, lower_bound_h, summarize
from ray_xlong.sim.simulator import SimResult, SimulationStalled, simulate
from ray_xlong.sim.workload import Workload, WorkloadConfig, sample_workload

__all__ = [
    "ClusterConfig", "CostConfig", "ModeSummary", "SimResult", "SimulationStalled", "Workload",
    "WorkloadConfig", "lower_bound_h", "sample_workload", "simulate", "summarize",
]
