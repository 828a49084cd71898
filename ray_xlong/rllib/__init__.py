"""The adapter to RLlib, and only that: ``XLongAlgorithm`` / ``XLongConfig`` + ``.xlong()``,
``enable()``, the RLModule and ``XLongLearner``, ``AgentEnvRunner`` / ``CellRunner`` (what a
cell hosts: ``cell_actors``), the ``PrefixTreeConnector`` and the episode format.

May import: ray.rllib, ``cells`` (the runtime it drives) and every layer below.

* :class:`PrefixTreeConnector` — a Learner ``ConnectorV2`` piece running the trajectory processor.
* :func:`run_to_episode` / :func:`runs_from_episodes` — how an ended ``AgentRun`` travels on an
  RLlib episode (``episode.custom_data[RUN_KEY]``).
"""

from ray_xlong.rllib.connector import (METRIC_KEYS, PrefixTreeConnector, batch_from_packed,
                                       packed_from_batch)
from ray_xlong.rllib.episodes import (RUN_ACTION_SPACE, RUN_KEY, RUN_OBSERVATION_SPACE,
                                      EpisodeError, run_to_episode, runs_from_episodes)

__all__ = [
    "EpisodeError", "METRIC_KEYS", "PrefixTreeConnector", "RUN_ACTION_SPACE", "RUN_KEY",
    "RUN_OBSERVATION_SPACE", "batch_from_packed", "packed_from_batch", "run_to_episode",
    "runs_from_episodes",
]
