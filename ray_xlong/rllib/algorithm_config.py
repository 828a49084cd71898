"""``XLongConfig``: the RLlib ``AlgorithmConfig`` of an xlong training job, with ``.xlong(...)``.

The import path of the config and its options; the class lives beside its algorithm in
``algorithm.py`` (RLlib's convention: config and algorithm know each other), the options in
``options.py``.

RLlib's builders keep their meaning; what RLlib has no word for goes through ``.xlong``::

    XLongConfig()
      .training(lr=1e-6, grad_clip=1.0, train_batch_size_per_learner=128)  runs per step
      .env_runners(num_env_runners=2, num_cpus_per_env_runner=1.0,        cells (one engine
                   num_gpus_per_env_runner=1)                             runner + learner each)
      .callbacks(MyCallbacks)                                             on_algorithm_init,
                                                                          on_train_result …
      .rl_module(model_config={"model_dir": ..., "dtype": "float32"})     the HF causal LM
      .debugging(seed=0)
      .xlong(mode="elastic", runs_per_group=8, staleness_bound=1, engine="vllm",
             task=MyTask, eval_task="my_eval")                            own task: a name
                                                                          or a factory
      .evaluation(evaluation_interval=5, evaluation_duration=32)          held-out rounds
      .build_algo()                                                       -> XLongAlgorithm

The defaults (lr 1e-6, :data:`AGENT_HARNESS`: 2048 tokens a call, 64 calls a run, a 32k
context) are for a real 1.5B–8B policy; :meth:`XLongConfig.lookup_recipe` sets the tiny lookup
recipe's (lr 5e-4, 8 tokens a call, 4 calls) for demos and tests on tiny CPU models.

One episode is one agent run, so batch sizes count runs: a step trains
``total_train_batch_size`` runs = ``groups`` × ``runs_per_group`` (must divide). Cells come from
``num_env_runners`` (a cell hosts one rollout runner and one Learner; ``num_learners`` stays 0:
the elastic learner group owns the Learners) or ``.xlong(cells=...)``; setting both to
different numbers is an error. :meth:`XLongConfig.job_config` combines everything into the
cell layer's job record (``config.CellJobConfig``).
"""

from __future__ import annotations

from ray_xlong.rllib.algorithm import XLongConfig
from ray_xlong.rllib.options import (AGENT_HARNESS, AGENT_LR, ENGINES, RECIPE_HARNESS, RECIPE_LR,
                                     XLongOptions, task_name)

__all__ = ["AGENT_HARNESS", "AGENT_LR", "ENGINES", "RECIPE_HARNESS", "RECIPE_LR", "XLongConfig",
           "XLongOptions", "task_name"]
