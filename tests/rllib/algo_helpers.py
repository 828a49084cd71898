"""What the shared trained algorithm (``conftest.trained_algo``) and the algorithm tests build
on: a recording callbacks class, a task as a user's script defines it, the small config
(2 cells, 2 groups × 4 runs per step, on a plain tiny model: plumbing, not learning) and the
size of the local Ray they run in (``SHARED_RAY``: ``test_algorithm.py``'s module Ray, in which
``conftest._train`` builds the shared algorithm when it is up).

Imported as ``algo_helpers`` (this folder is on ``sys.path`` under pytest), so a saved config
names ``algo_helpers.RecordingCallbacks``: a new process imports it only once the folder is on
its path (``test_from_checkpoint_continues_in_a_new_process``).
"""

from __future__ import annotations

from ray.rllib.callbacks.callbacks import RLlibCallback

from ray_xlong.rllib.algorithm_config import XLongConfig


class RecordingCallbacks(RLlibCallback):
    """Records what RLlib's callback hooks saw (driver process)."""

    seen: list = []

    def on_algorithm_init(self, *, algorithm, **kwargs):
        RecordingCallbacks.seen.append(("init", None))

    def on_train_result(self, *, algorithm, result, **kwargs):
        RecordingCallbacks.seen.append(("result", result["xlong"]["policy_version"]))


def user_task():
    """A task as a user's script defines it: built in a function, so that it is pickled by
    value (like a class of a script's ``__main__``), never imported by the cells."""
    from ray_xlong.rollout.tasks import Observation, ToolError

    class Echo:
        """Say the word back (reward 1 when the answer holds it)."""

        tools = ()

        def __init__(self, seed):
            self.word, self.answer = ("red", "green", "blue", "amber")[seed % 4], None

        def reset(self):
            self.answer = None
            return Observation("Repeat the word.", f"Say {self.word}.")

        async def call_tool(self, name, args):
            raise ToolError(f"no tools (called {name!r})")

        def submit(self, answer):
            self.answer = answer

        def score(self):
            return float(self.answer is not None and self.word in self.answer)

        def close(self):
            pass

    return Echo


ENGINE_SETTINGS_KW = dict(gpu_memory_utilization=0.3, enable_prefix_caching=False)
"""Engine settings of the shared trained algorithm (not the defaults: they must reach the
cells)."""


SHARED_RAY = dict(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
"""The local Ray the shared algorithm is built in: 2 CPUs, 4 logical GPUs (2 cells × 2)."""


def has_shared_resources(ray) -> bool:
    """Whether a Ray is up with exactly :data:`SHARED_RAY`'s CPUs and GPUs (one the shared
    algorithm can be built in, as in a Ray of its own)."""
    if not ray.is_initialized():
        return False
    total = ray.cluster_resources()
    return (total.get("CPU"), total.get("GPU")) == (SHARED_RAY["num_cpus"],
                                                    SHARED_RAY["num_gpus"])


def small_config(model_dir: str, *, mode: str = "elastic", seed: int = 0) -> XLongConfig:
    """2 cells, 2 groups × 4 runs per step, on a plain tiny model (plumbing, not learning)."""
    return (XLongConfig().lookup_recipe().training(train_batch_size_per_learner=8)
            .debugging(seed=seed)
            .callbacks(RecordingCallbacks)
            .xlong(mode=mode, cells=2, runs_per_group=4, slots_per_cell=8, model_dir=model_dir,
                   placement_strategy="PACK"))


def scripted_factory(model_dir):
    """An engine factory whose ``ScriptedEngine`` solves the arithmetic task in the token
    format: one ``add`` call with the question's two numbers, then the tool's result as the
    answer."""
    from ray_xlong.models import load_tokenizer
    from ray_xlong.rollout import ScriptedEngine, TokenFormat

    chat = TokenFormat(load_tokenizer(model_dir))

    def policy(ids):
        text = chat.decode(ids)
        if "<|tool|>" not in text:
            a, b = text.split("What is ")[1].split("?")[0].split(" plus ")
            return chat.call_ids("add", f"{a} {b}")
        return chat.answer_ids(text.split("<|tool|>")[-1].split("<|end|>")[0])
    return lambda: ScriptedEngine(policy, vocab_size=512)
