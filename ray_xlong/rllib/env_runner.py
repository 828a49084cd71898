"""``AgentEnvRunner``: an RLlib 2.60 ``EnvRunner`` hosting one engine and the runs of its cell.

RLlib's env runners step gym envs; a cell's rollout worker instead hosts an inference engine and
the long agent runs pinned to it (their contexts live in its prefix cache). Everything runs on
one asyncio loop in a background thread; the actor's methods are synchronous::

    start_runs([RunSpec(task, seed, run_id, group_id), ...])   runs start at once (not while
                                                                draining or asleep)
    num_live_runs()                                            runs started and not ended
    sample(min_runs=0, timeout_s=0.0) -> [SingleAgentEpisode]  the runs that ended since the
                                                                last call (run_to_episode)
    drain() / undrain()                                        take no new runs / take again
    sleep() / wake_up()                                        lend the engine's memory; only
                                                                when no run is live
    set_weights(state_dict, version)                           applied between engine batches
    endpoint_url()                                             the cell's OpenAI-compatible
                                                                endpoint (ray_xlong.serving)
    get_metrics() / get_state() / set_state() / stop()

Configuration: a :class:`RolloutConfig`, given as the ``rollout_config`` keyword or under
``config.env_config["xlong_rollout"]`` (how RLlib's ``EnvRunnerGroup`` passes it).

Invariants: a live run is never interrupted (``sleep`` with live runs raises; weights change
between batches); every ended run is returned by exactly one ``sample`` call; an unknown task
name raises before anything starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from ray_xlong.cells.cell_engines import hosting
from ray_xlong.cells.runs import RunSpec  # noqa: F401 (re-exported: what start_runs takes)
from ray_xlong.rllib.episodes import RUN_ACTION_SPACE, RUN_OBSERVATION_SPACE, run_to_episode
from ray_xlong.rollout import Engine, HFEngine, Harness, HarnessConfig, RunResult, load_chat_format
from ray_xlong.rollout.engine_settings import EngineSettings
from ray_xlong.rollout.tasks import TASKS, UnknownTaskError, make_task
from ray_xlong.serving.agents import AGENT_TASKS, run_agent

EngineFactory = Callable[[], Engine]
"""``make() -> Engine``: builds the runner's engine (called once, on the runner's loop)."""


ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
"""``RolloutConfig.dtype`` names."""


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutConfig:
    """What an :class:`AgentEnvRunner` hosts."""

    model_dir: str
    """Directory of the model + tokenizer (``ray_xlong.models.build_tiny_model_dir``)."""
    backend: str = "hf"
    """``hf`` | ``vllm`` (ignored when ``engine_factory`` is given)."""
    harness: HarnessConfig = HarnessConfig()
    """Budgets of each run."""
    max_batch_size: int = 16
    """Engine batch size."""
    seed: int = 0
    """Engine seed."""
    dtype: str = "float32"
    """Engine weight / compute dtype: ``float32`` | ``bfloat16`` (``float64``: HF only). The
    Learner's ``LearnerSettings.dtype`` is passed here, so both load the same weights."""
    engine_factory: EngineFactory | None = None
    """Builds the engine instead of ``backend`` (e.g. a scripted engine)."""
    engine_settings: EngineSettings = EngineSettings()
    """The vLLM engine's long-context settings (``max_model_len`` None: the model's own,
    ``tensor_parallel_size``, CUDA graphs, prefix caching); ``backend="vllm"`` only."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"RolloutConfig.model_dir must be a path string, "
                             f"got {self.model_dir!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"RolloutConfig.backend must be 'hf' or 'vllm', "
                             f"got {self.backend!r}")
        if not isinstance(self.harness, HarnessConfig):
            raise ValueError("RolloutConfig.harness must be a HarnessConfig")
        if self.dtype not in ENGINE_DTYPES or (self.backend == "vllm"
                                                and self.dtype == "float64"):
            allowed = ("float32", "bfloat16") if self.backend == "vllm" else tuple(ENGINE_DTYPES)
            raise ValueError(f"RolloutConfig.dtype must be one of {allowed} for backend "
                             f"{self.backend!r}, got {self.dtype!r}")
        if not isinstance(self.engine_settings, EngineSettings):
            raise ValueError(f"RolloutConfig.engine_settings must be an EngineSettings, "
                             f"got {self.engine_settings!r}")
        if self.backend == "hf" and self.engine_settings.tensor_parallel_size != 1:
            raise ValueError(f"RolloutConfig.engine_settings.tensor_parallel_size="
                             f"{self.engine_settings.tensor_parallel_size} needs backend='vllm'"
                             f" (the hf engine runs on one device)")


def vllm_engine_kwargs(cfg: RolloutConfig) -> dict:
    """``VLLMEngine`` keyword arguments of ``cfg`` (its engine settings passed through)."""
    es = cfg.engine_settings
    return dict(max_batch_size=cfg.max_batch_size, seed=cfg.seed, dtype=cfg.dtype,
                max_model_len=es.max_model_len, tensor_parallel_size=es.tensor_parallel_size,
                enforce_eager=es.enforce_eager, enable_prefix_caching=es.enable_prefix_caching,
                gpu_memory_utilization=es.gpu_memory_utilization)


class AgentEnvRunner(EnvRunner):
    """Hosts one engine and the agent runs pinned to it (see module docstring)."""

    def __init__(self, *, config, rollout_config: RolloutConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        cfg = rollout_config or (config.env_config or {}).get("xlong_rollout")
        if not isinstance(cfg, RolloutConfig):
            raise ValueError("AgentEnvRunner needs a RolloutConfig (rollout_config= or "
                             "config.env_config['xlong_rollout'])")
        self.rollout_config = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="xlong-rollout-loop")
        self._thread.start()
        self._live: dict[str, asyncio.Task] = {}
        self._ended: list[RunResult] = []
        self._news = threading.Event()
        """Set when a run ended (waiters wake on it instead of polling)."""
        self._draining = False
        self._stopped = False
        self.engine = hosting(self._call(self._build_engine()))
        """The runner's engines (``cells.protocols.EngineHosting``: one engine is a one-engine
        ``EngineSet``)."""
        self.harness = Harness(self.engine, load_chat_format(cfg.model_dir),
                               config=cfg.harness)
        self.endpoint = None             # ray_xlong.serving: started by endpoint_url()

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _build_engine(self) -> Engine:
        cfg = self.rollout_config
        if cfg.engine_factory is not None:
            return cfg.engine_factory()
        if cfg.backend == "vllm":
            from ray_xlong.rollout.vllm_engine import VLLMEngine

            return VLLMEngine(cfg.model_dir, **vllm_engine_kwargs(cfg))
        return HFEngine(cfg.model_dir, max_batch_size=cfg.max_batch_size, seed=cfg.seed,
                        dtype=ENGINE_DTYPES[cfg.dtype])

    # -- runs -------------------------------------------------------------------------------
    def start_runs(self, specs: Sequence[RunSpec]) -> list[str]:
        """Start ``specs`` now; returns their run ids. Raises when draining, asleep or stopped,
        on an unknown task or a run id already used."""
        if self._draining or self._stopped or self.engine.is_sleeping:
            raise RuntimeError("AgentEnvRunner takes no new runs (draining, asleep or stopped)")
        if any(spec.task in AGENT_TASKS for spec in specs):
            self.endpoint_url()
        for spec in specs:
            if spec.task not in TASKS and spec.task not in AGENT_TASKS:
                raise UnknownTaskError(f"RunSpec.task {spec.task!r} (run {spec.run_id!r}) is "
                                       f"not a registered task; known: {sorted(TASKS)}")
            if spec.run_id in self._live:
                raise ValueError(f"RunSpec.run_id {spec.run_id!r} is already live")
        return self._call(self._start(list(specs)))

    async def _start(self, specs: list[RunSpec]) -> list[str]:
        for spec in specs:
            if spec.task in AGENT_TASKS:      # an external agent, through the cell's endpoint
                env, run = None, run_agent(self.endpoint, AGENT_TASKS[spec.task](spec.seed),
                                           run_id=spec.run_id, group_id=spec.group_id)
            else:
                env = make_task(spec.task, seed=spec.seed)
                run = self.harness.run(env, run_id=spec.run_id, group_id=spec.group_id)
            task = asyncio.get_running_loop().create_task(run)
            self._live[spec.run_id] = task
            task.add_done_callback(lambda t, rid=spec.run_id, e=env: self._on_end(rid, e, t))
        return [s.run_id for s in specs]

    def _on_end(self, run_id: str, env, task: asyncio.Task) -> None:
        self._live.pop(run_id, None)
        if env is not None:
            env.close()
        if not task.cancelled():
            self._ended.append(task.result())
        self._news.set()

    def _wait_until(self, done, timeout_s: float) -> None:
        """Block until ``done()`` holds or ``timeout_s`` passed, woken by ended runs."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._news.wait(left)
            self._news.clear()          # ``done()`` is checked again: no wake-up is lost

    def num_live_runs(self) -> int:
        """Runs started and not yet ended (endpoint runs included)."""
        return len(self._live) + (len(self.endpoint.runs.live) if self.endpoint else 0)

    def endpoint_url(self, host: str = "127.0.0.1") -> str:
        """The URL of this cell's OpenAI-compatible endpoint (``ray_xlong.serving``), on
        this cell's engine; started on first use."""
        if self.endpoint is None:
            from ray_xlong.serving.cell import attach

            self.endpoint, self._server = self._call(
                attach(self.engine, self.rollout_config.model_dir, host=host))
            self.endpoint.runs.draining = self._draining
        return self.endpoint.url

    def sample(self, *, min_runs: int = 0, timeout_s: float = 0.0,
               **_rllib_kwargs: Any) -> list[SingleAgentEpisode]:
        """Episodes of the runs that ended since the last call (waits up to ``timeout_s`` for
        at least ``min_runs``). RLlib's ``num_timesteps`` / ``explore`` … are ignored."""
        self._wait_until(lambda: len(self._ended) >= min_runs, timeout_s)
        results = self._call(self._take())
        self.num_env_steps_sampled_lifetime += len(results)
        return [run_to_episode(r.run) for r in results]

    async def _take(self) -> list[RunResult]:
        taken, self._ended = self._ended, []
        return taken

    def sample_results(self) -> list[RunResult]:
        """Like ``sample`` but the harness's :class:`RunResult` objects (runs + run info)."""
        return self._call(self._take())

    # -- cell role --------------------------------------------------------------------------
    def drain(self) -> None:
        """Take no new runs; live runs go on."""
        self._draining = True
        if self.endpoint is not None:
            self.endpoint.runs.draining = True

    def undrain(self) -> None:
        """Take new runs again."""
        self._draining = False
        if self.endpoint is not None:
            self.endpoint.runs.draining = False

    def sleep(self) -> None:
        """Release the engine's memory. Raises if a run is live (never interrupts one)."""
        if self.num_live_runs():
            raise RuntimeError(f"cannot sleep with {self.num_live_runs()} live runs; drain "
                               f"first")
        self._call(self.engine.sleep())

    def wake_up(self) -> None:
        """Restore the engine."""
        self._call(self.engine.wake_up())

    def set_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights of ``version``, applied between engine batches (returns once applied)."""
        self._call(self.engine.update_weights(state_dict, version=version))

    @property
    def policy_version(self) -> int:
        """Version of the engine's weights."""
        return self.engine.policy_version

    # -- EnvRunner API ----------------------------------------------------------------------
    def get_spaces(self):
        spaces = (RUN_OBSERVATION_SPACE, RUN_ACTION_SPACE)
        return {"__env__": spaces, DEFAULT_MODULE_ID: spaces}

    def assert_healthy(self) -> None:
        assert self._thread.is_alive() and not self._stopped, "AgentEnvRunner is not healthy"

    def get_metrics(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"live_runs": len(self._live), "ended_runs_waiting": len(self._ended),
                "policy_version": self.engine.policy_version, "draining": self._draining,
                "engine": dataclasses.asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate}

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        return {"policy_version": self.engine.policy_version, "draining": self._draining}

    def set_state(self, state: dict[str, Any]) -> None:
        self._draining = bool(state.get("draining", self._draining))

    def stop(self) -> None:
        """Cancel live runs, close the engine and the loop."""
        if self._stopped:
            return
        self._stopped = True

        async def _shutdown() -> None:
            for task in list(self._live.values()):
                task.cancel()
            if self.endpoint is not None:
                await self._server.stop()
            await self.engine.close()

        self._call(_shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
