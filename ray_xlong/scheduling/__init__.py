"""Cell state machine and mode policies (pure: no ray, no vllm, no torch).

Deciding (``policy.decide(state, event) -> moves``) is separate from acting (the simulator in
``ray_xlong.sim``, the Ray actuator in ``ray_xlong.cells``); :class:`CellMachine` validates
every move for both.

May import: the standard library only (nothing else of ours).
"""

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.events import Event, from_jsonl, to_jsonl
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.ledger import GroupLedger, StalenessError
from ray_xlong.scheduling.machine import CellMachine, TransitionError
from ray_xlong.scheduling.moves import Drain, JoinStep, Move, Reserve, StartRuns, StartTraining, Sync
from ray_xlong.scheduling.policy import Policy
from ray_xlong.scheduling.state import CellState, ClusterState, Role, SchedulingConfig

__all__ = [
    "AsyncPolicy", "CellMachine", "CellState", "ClusterState", "ColocatedPolicy", "Drain",
    "ElasticPolicy", "Event", "ForecastPolicy", "GroupLedger", "JoinStep", "Move", "Policy",
    "Reserve", "Role",
    "SchedulingConfig", "StalenessError", "StartRuns", "StartTraining", "Sync", "TransitionError",
    "from_jsonl", "to_jsonl",
]
