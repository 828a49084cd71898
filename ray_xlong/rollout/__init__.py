"""Rollout: inference engines (HF, vLLM, scripted), the agent harness and tasks.

* ``engine.py`` — the :class:`Engine` interface and the shared batching loop;
  ``hf_engine.py`` / ``vllm_engine.py`` / ``scripted.py`` — the backends.
* ``chat.py`` / ``context.py`` — the token-level chat format and the context buffer.
* ``harness.py`` — :class:`Harness`: concurrent agent runs → token-exact ``AgentRun`` records.
* ``tasks/`` — the task interface and the arithmetic, code and long-horizon tasks.

``vllm_engine`` is not imported here (vLLM is optional).

May import: ``models`` and ``trajectory`` (never ``cells``, ``rllib`` or ``tools``).
"""

from ray_xlong.rollout.chat import Answer, ChatFormat, Malformed, ToolCall
from ray_xlong.rollout.context import Context, ContextFull
from ray_xlong.rollout.engine import (BatchingEngine, Engine, EngineError, EngineStats,
                                      GenerateResult, SamplingConfig)
from ray_xlong.rollout.harness import Harness, HarnessConfig, RunInfo, RunResult
from ray_xlong.rollout.hf_engine import HFEngine
from ray_xlong.rollout.scripted import ScriptedEngine, ScriptedPolicy

__all__ = ["Answer", "BatchingEngine", "ChatFormat", "Context", "ContextFull", "Engine",
           "EngineError", "EngineStats", "GenerateResult", "HFEngine", "Harness",
           "HarnessConfig", "Malformed", "RunInfo", "RunResult", "SamplingConfig",
           "ScriptedEngine", "ScriptedPolicy", "ToolCall"]
