"""Rollout: inference engines (HF, vLLM, scripted), the agent harness and tasks.

* ``engine.py`` — the :class:`Engine` interface; ``batching.py`` — the loop the backends
  share (continuous batching, weights and sleep between batches);
  ``hf_engine.py`` / ``vllm_engine.py`` / ``scripted.py`` — the backends.
* ``chat.py`` — the chat-format interface; ``token_format.py`` (the tiny demo model's own
  tokens) and ``template_format.py`` (any HF chat template); ``tool_calls.py`` — tool-call
  parsing (vLLM's parsers) and tool schemas; ``context.py`` — the context buffer.
* ``harness.py`` — :class:`Harness`: concurrent agent runs → token-exact ``AgentRun`` records.
* ``tasks/`` — the task interface and the arithmetic, code and long-horizon tasks.

``vllm_engine`` is not imported here (vLLM is optional).

May import: ``models`` and ``trajectory`` (never ``cells``, ``rllib`` or ``tools``).
"""

from ray_xlong.rollout.chat import (Answer, ChatFormat, ChatFormatError, Malformed, ToolCall,
                                    ToolCalls)
from ray_xlong.rollout.formats import load_chat_format
from ray_xlong.rollout.context import Context, ContextFull
from ray_xlong.rollout.batching import BatchingEngine
from ray_xlong.rollout.engine import Engine, EngineError, EngineStats, GenerateResult, SamplingConfig
from ray_xlong.rollout.harness import Harness
from ray_xlong.rollout.run_records import HarnessConfig, RunInfo, RunResult
from ray_xlong.rollout.hf_engine import HFEngine
from ray_xlong.rollout.scripted import ScriptedEngine, ScriptedPolicy
from ray_xlong.rollout.token_format import TokenFormat

__all__ = ["Answer", "BatchingEngine", "ChatFormat", "ChatFormatError", "Context", "ContextFull",
           "Engine",
           "EngineError", "EngineStats", "GenerateResult", "HFEngine", "Harness",
           "HarnessConfig", "Malformed", "RunInfo", "RunResult", "SamplingConfig",
           "ScriptedEngine", "ScriptedPolicy", "TokenFormat", "ToolCall", "ToolCalls",
           "load_chat_format"]
