"""Enable ray_xlong on an RLlib config you already have, then train a couple of steps.

    python examples/enable_on_existing_config.py          # ~1 min on 2 CPU cores

``ray_xlong.enable(config, **xlong_options)`` keeps what you changed (lr, batch size, grad clip,
callbacks, resources, learner connector pieces, seed) and installs the xlong cells, Learner,
trajectory connector and algorithm; a setting with no xlong meaning is named in an error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.callbacks.callbacks import RLlibCallback

import ray_xlong


class PrintRewards(RLlibCallback):
    """Your callbacks keep working: RLlib calls them on the xlong algorithm."""

    def on_train_result(self, *, algorithm, result, **kwargs):
        x = result["xlong"]
        print(f"  step {int(x['policy_version'])}: reward "
              f"{result['env_runners']['episode_return_mean']:.3f}, tokens trained "
              f"{int(x['tokens_trained'])}, cells rollout/training "
              f"{int(x['cells_rollout'])}/{int(x['cells_training'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.algorithm_config import RECIPE_HARNESS
    from ray_xlong.rllib.enable import EnableError
    from ray_xlong.jobs.train import ensure_ray

    # 1. The config you already had.
    mine = (PPOConfig()
            .training(lr=3e-4, train_batch_size_per_learner=8, grad_clip=0.5)
            .callbacks(PrintRewards)
            .env_runners(num_env_runners=2)
            .debugging(seed=0))

    # 2. One call. A setting with no xlong meaning is named, not dropped:
    try:
        ray_xlong.enable(PPOConfig().training(gamma=0.9, entropy_coeff=0.01))
    except EnableError as err:
        print(f"as expected: {err}\n")

    model_dir = str(build_tiny_model_dir(tempfile.mkdtemp(prefix="rx-policy-"), seed=0))
    config = ray_xlong.enable(mine, mode="elastic", runs_per_group=4, model_dir=model_dir,
                              engine="hf", slots_per_cell=8, placement_strategy="PACK",
                              harness=RECIPE_HARNESS)     # a tiny model's run budgets
    print(f"kept: lr={config.lr} grad_clip={config.grad_clip} runs/step="
          f"{config.total_train_batch_size} ({config.groups_per_step} groups x 4) "
          f"callbacks={config.callbacks_class.__name__} cells={config.num_cells}")

    # 3. Train as usual.
    ensure_ray(cpus=2, gpus=config.num_cells)
    algo = config.build_algo()
    try:
        for _ in range(args.steps):
            algo.train()
    finally:
        algo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
