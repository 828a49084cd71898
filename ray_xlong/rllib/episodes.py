"""How an ended agent run travels through RLlib: one ``SingleAgentEpisode`` per :class:`AgentRun`.

RLlib's new API stack moves experience from EnvRunners to Learners as episodes. An agent run is
not a gym MDP (its "steps" are model calls of hours-long length, its actions are token
sequences), so the episode is only an envelope: the run itself rides in ``custom_data``::

    SingleAgentEpisode(id_=run.run_id)            one run = one episode = one env step
      observations  [[0.], [0.]]                  reset obs + final obs   (RUN_OBSERVATION_SPACE)
      actions       [0]                           one placeholder action  (RUN_ACTION_SPACE)
      rewards       [run.reward]                  so RLlib's episode-return metrics = run reward
      terminated    run.status == "finished"
      truncated     run.status in ("timeout", "failed")
      custom_data   {RUN_KEY: run}                the token-exact AgentRun (not copied)
      module_id     the RLModule that trains it   (None = DEFAULT_MODULE_ID)

Invariants:

* The episode is valid and done (``validate()`` passes, ``is_done``), so it can be finalized
  (``to_numpy()``), pickled to a Learner and counted by RLlib (``len(episode) == 1``).
* The run object is stored as-is (no token copied); ``custom_data`` survives pickling,
  ``get_state`` / ``from_state`` and ``cut``.
* :func:`runs_from_episodes` never skips an episode: one without a run, with something else under
  :data:`RUN_KEY`, or not done raises :class:`EpisodeError` naming the episode id.
* A group's runs are trained by one module (advantages are per group): a group split over
  modules raises.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import gymnasium as gym
import numpy as np
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from ray_xlong.trajectory import AgentRun
from ray_xlong.trajectory.per_run import ProcessedRun, process_run
from ray_xlong.trajectory.processor import ProcessorConfig

RUN_KEY = "xlong_run"
"""``episode.custom_data[RUN_KEY]`` holds the episode's :class:`AgentRun`."""

PROCESSED_KEY = "xlong_processed"
"""``episode.custom_data[PROCESSED_KEY]``: the run's ``ProcessedRun`` when the rollout cell
already processed it where it ended (``trajectory.per_run.process_run``); absent otherwise."""

RUN_OBSERVATION_SPACE = gym.spaces.Box(0.0, 0.0, (1,), np.float32)
"""The placeholder observation space of a run episode (every observation is ``[0.0]``; a Box so
that RLlib's default catalogs and connectors accept it)."""

RUN_ACTION_SPACE = gym.spaces.Discrete(1)
"""The placeholder action space of a run episode (the single action is 0)."""


_OBS = np.zeros(1, np.float32)


class EpisodeError(ValueError):
    """An episode does not carry a usable agent run. The message names the episode id."""


def run_to_episode(run: AgentRun, *, module_id: str | None = None,
                   processed: ProcessedRun | None = None) -> SingleAgentEpisode:
    """Wrap an ended run into a done, one-step ``SingleAgentEpisode`` (see module docstring).

    Args:
        run: the ended, scored run.
        module_id: the RLModule that trains the run (None: the default module).
        processed: the run already processed where it ended (stored under
            :data:`PROCESSED_KEY`; the connector then packs it without processing it again).

    Returns:
        The episode, id ``run.run_id``, with the run under ``custom_data[RUN_KEY]``.
    """
    if not isinstance(run, AgentRun):
        raise TypeError(f"run_to_episode: run must be an AgentRun, got {type(run).__name__}")
    episode = SingleAgentEpisode(id_=run.run_id, observation_space=RUN_OBSERVATION_SPACE,
                                 action_space=RUN_ACTION_SPACE, module_id=module_id)
    episode.add_env_reset(observation=_OBS)
    episode.add_env_step(observation=_OBS, action=0, reward=run.reward,
                         terminated=run.status == "finished",
                         truncated=run.status != "finished")
    episode.custom_data[RUN_KEY] = run
    if processed is not None:
        if processed.digest.run_id != run.run_id:
            raise ValueError(f"run_to_episode.processed: holds run {processed.digest.run_id!r}"
                             f", not {run.run_id!r}")
        episode.custom_data[PROCESSED_KEY] = processed
    episode.validate()
    return episode


def single_agent_episodes(episodes: Iterable[object]) -> list[SingleAgentEpisode]:
    """Single-agent episodes of ``episodes``; a ``MultiAgentEpisode`` gives its agents' ones."""
    out: list[SingleAgentEpisode] = []
    for i, episode in enumerate(episodes):
        if isinstance(episode, MultiAgentEpisode):
            out.extend(episode.agent_episodes.values())
        elif isinstance(episode, SingleAgentEpisode):
            out.append(episode)
        else:
            raise EpisodeError(f"episodes[{i}] is a {type(episode).__name__}, not a "
                               f"SingleAgentEpisode or MultiAgentEpisode")
    return out


def run_of(episode: SingleAgentEpisode) -> AgentRun:
    """The run an episode carries; raises :class:`EpisodeError` naming the episode otherwise."""
    run = episode.custom_data.get(RUN_KEY)
    if run is None:
        raise EpisodeError(f"episode {episode.id_!r} carries no agent run: "
                           f"custom_data[{RUN_KEY!r}] is missing (build episodes with "
                           f"ray_xlong.rllib.episodes.run_to_episode)")
    if not isinstance(run, AgentRun):
        raise EpisodeError(f"episode {episode.id_!r}: custom_data[{RUN_KEY!r}] is a "
                           f"{type(run).__name__}, not an AgentRun")
    if not episode.is_done:
        raise EpisodeError(f"episode {episode.id_!r} (run {run.run_id!r}) is not done: only "
                           f"ended runs are trained")
    return run


def runs_from_episodes(episodes: Sequence[object]) -> list[AgentRun]:
    """The runs carried by ``episodes``, in order (multi-agent episodes: per agent).

    Args:
        episodes: ``SingleAgentEpisode`` / ``MultiAgentEpisode`` objects made by
            :func:`run_to_episode` (or carrying a run under :data:`RUN_KEY`).

    Returns:
        One run per single-agent episode.

    Raises:
        EpisodeError: an episode carries no run, something else, or is not done.
    """
    return [run_of(e) for e in single_agent_episodes(episodes)]


def runs_by_module(episodes: Sequence[object]) -> dict[str, list[AgentRun]]:
    """The runs of ``episodes`` grouped by ``episode.module_id`` (None → DEFAULT_MODULE_ID).

    Modules appear in first-seen order, runs in episode order.

    Raises:
        EpisodeError: as :func:`runs_from_episodes`, or a group's runs span several modules.
    """
    by_module: dict[str, list[AgentRun]] = {}
    group_module: dict[str, str] = {}
    for episode in single_agent_episodes(episodes):
        run = run_of(episode)
        module_id = episode.module_id if episode.module_id is not None else DEFAULT_MODULE_ID
        known = group_module.setdefault(run.group_id, module_id)
        if known != module_id:
            raise EpisodeError(f"episode {episode.id_!r} (run {run.run_id!r}): group "
                               f"{run.group_id!r} is split over modules {known!r} and "
                               f"{module_id!r}; a group's runs must share one module")
        by_module.setdefault(module_id, []).append(run)
    return by_module


def processed_by_run(episodes: Sequence[object]) -> dict[str, ProcessedRun]:
    """Run id → the ``ProcessedRun`` the episodes carry (those processed where they ended)."""
    out = {}
    for episode in single_agent_episodes(episodes):
        processed = episode.custom_data.get(PROCESSED_KEY)
        if processed is not None:
            out[run_of(episode).run_id] = processed
    return out


def processed_runs(episodes: Sequence[object], *, wanted: Iterable[str],
                   config: ProcessorConfig) -> dict[str, ProcessedRun]:
    """Run id → ``ProcessedRun`` of the episodes' runs in ``wanted``: the one processed where
    the run ended, else processed here with ``config`` (what ``PrefixTreeConnector`` packs;
    a sharded cell's ranks read their micro-batches with it)."""
    wanted, out = set(wanted), {}
    for episode in single_agent_episodes(episodes):
        run = run_of(episode)
        if run.run_id in wanted:
            out[run.run_id] = (episode.custom_data.get(PROCESSED_KEY)
                               or process_run(run, config))
    return out
