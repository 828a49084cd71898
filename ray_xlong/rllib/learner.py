"""``XLongLearner``: an RLlib ``TorchLearner`` with the token-level loss, driven micro-batch by
micro-batch by the elastic learner group (``learner_group.py``).

RLlib's ``Learner.update`` runs a whole batch on a fixed group; a cell's Learner instead takes
part in a step for as many micro-batches as the scheduler gives it, so the step is split::

    wake_up(state, version)        load the step's weights + optimizer state if behind
    accumulate(micro) × k          grad += ∇ Σ loss_scale · ℓ   (un-normalised; local, no reduce;
                                   ``trajectory.accumulate.accumulate_loss``, the one shared
                                   implementation; tree rows attend with ``xlong_tree``)
    take_gradients()               → {param name: summed grad} (zeros if it took no micro-batch)
    apply_step(grads, total)       grad = Σ grads / total; one optimizer step; version + 1
    get_state() / get_weights()    what joiners and engines load

A micro-batch's ``loss_scale`` arrives multiplied by the normalizer of the chunk it came from
(``learner_group.chunk``: its ``num_targets`` for ``loss_norm="token"``), so ``accumulate``
adds *un-normalised* token-loss gradients and ``apply_step`` divides by the step's total: the update equals the gradient of the whole batch
processed at once, however the micro-batches were spread over cells (docs/design.md invariant 7).
Every participant applies the same reduced gradient in the same order, so their weights and
Adam moments stay identical; a cell that did not take part reloads the state when it joins.

Loss (``compute_loss_for_module``): ``policy_loss(token_logprobs(lm, packed), packed, loss)``
— truncated importance ratio or PPO clip against the behaviour logprobs, count-once weights in
``loss_scale``. Config: ``AlgorithmConfig.learner_config_dict["xlong"]`` is a
:class:`LearnerSettings`.

Learners never request "GPU" on a machine without CUDA (RLlib would try NCCL on logical GPUs):
the cell gives them CPU from its bundle (``cells.py``).
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import ray
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

from ray_xlong.cells.collectives import count
from ray_xlong.cells.config import DTYPES, LearnerSettings  # noqa: F401 (re-exported)
from ray_xlong.rllib.connector import ADVANTAGES_KEY, PrefixTreeConnector
from ray_xlong.trajectory import ProcessorConfig
from ray_xlong.trajectory.accumulate import accumulate_loss
from ray_xlong.trajectory.loss import policy_loss
from ray_xlong.trajectory.loss_stats import LearnerStepStats, LossStats, StepStatsLog
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import PackedBatch


class XLongModule(TorchRLModule):
    """An RLModule holding a HF causal LM (``model_config``: ``model_dir``, ``dtype``,
    ``attn_implementation`` — ``LearnerSettings.model_attention``, default ``xlong_tree``)."""

    def setup(self) -> None:
        from ray_xlong.models import load_model
        from ray_xlong.trajectory.tree_attention import ATTN_IMPLEMENTATION
        from ray_xlong.trajectory.tree_attention import register as register_tree_attention

        from ray_xlong.models.tiny import full_precision_norms

        cfg = self.model_config or {}
        attention = cfg.get("attn_implementation", "xlong_tree")
        if attention == ATTN_IMPLEMENTATION:
            register_tree_attention()
        self.lm = load_model(cfg["model_dir"], dtype=DTYPES[cfg.get("dtype", "float32")],
                             attn_implementation=attention)
        if cfg.get("dtype") == "float64":
            full_precision_norms(self.lm)  # HF norms compute in fp32 otherwise
        self.lm.train()

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {}  # the loss reads the LM directly (token_logprobs on packed batches)


class XLongLearner(TorchLearner):
    """TorchLearner with the token loss and the elastic step API (module docstring)."""

    def build(self) -> None:
        super().build()
        self.settings: LearnerSettings = self.config.learner_config_dict["xlong"]
        self.version = 0
        self.asleep = False
        self.micro_batches = 0
        self.tokens = 0
        self.step_stats = StepStatsLog()   # by the version trained
        self.last_loss_stats = LossStats()
        # KL to a reference policy: the starting weights, frozen (one more copy of the model).
        self.reference = None
        if self.settings.loss.needs_reference:
            self.reference = copy.deepcopy(self.lm).eval().requires_grad_(False)

    @property
    def lm(self) -> torch.nn.Module:
        return self.module[DEFAULT_MODULE_ID].lm

    def compute_loss_for_module(self, *, module_id: str, config: Any = None,
                                batch: Mapping[str, Any], fwd_out: Any = None) -> torch.Tensor:
        """``Σ loss_scale · ℓ`` of one packed module batch (see ``trajectory.loss``)."""
        packed = PackedBatch.from_tensors(batch)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, packed)
        loss, _ = policy_loss(token_logprobs(self.module[module_id].lm, packed), packed,
                              self.settings.loss, ref_logprobs=ref)
        return loss

    # -- the elastic step ----------------------------------------------------------------------
    def accumulate(self, micro_batch: Mapping[str, torch.Tensor],
                   version: int | None = None) -> int:
        """Add ``∇ loss(micro_batch)`` to the local gradient; returns its targets. ``version``:
        the weights the step trains (raises if this learner holds others)."""
        self._check_version("accumulate", version)
        return self._train(PackedBatch.from_tensors(micro_batch))

    def _train(self, packed: PackedBatch) -> int:
        """Accumulate one packed micro-batch's gradient; note its loss statistics and time."""
        start = time.perf_counter()
        part = accumulate_loss(self.lm, packed, config=self.settings.loss,
                               reference=self.reference)
        self._note_step(loss=part.stats, train_s=time.perf_counter() - start)
        self.micro_batches += 1
        self.tokens += part.targets
        return part.targets

    def accumulate_runs(self, run_ids: Sequence[str], advantages: Sequence[float],
                        version: int | None, *payloads: Sequence[Any]) -> int:
        """Train the runs ``run_ids`` (with their group-wide ``advantages``) as one
        micro-batch: their episodes go through this Learner's connector pipeline — the user's
        learner connector pieces, then ``PrefixTreeConnector`` packing them (RLlib's order) —
        and the packed batch's loss gradient is added locally. Returns its targets.

        Args:
            run_ids: the runs of the micro-batch.
            advantages: their advantages, in the same order.
            version: the weights the step trains (raises if this learner holds others).
            *payloads: lists of episodes from the rollout cells where the runs ended (Ray
                resolves the refs; episodes of other runs are ignored).
        """
        self._check_version("accumulate_runs", version)
        batch = run_pipeline(self._learner_connector, run_ids, advantages, payloads,
                             rl_module=self.module, metrics=self.metrics,
                             who="XLongLearner.accumulate_runs")
        return self._train(PackedBatch.from_tensors(batch))

    def _check_version(self, call: str, version: int | None) -> None:
        if self.asleep:
            raise RuntimeError(f"XLongLearner.{call}: the learner is asleep (wake_up first)")
        if version is not None and version != self.version:
            raise RuntimeError(f"XLongLearner.{call}: learner at version {self.version}, "
                               f"the step trains version {version} (reload its state first)")

    def take_gradients(self) -> dict[str, torch.Tensor]:
        """The summed local gradient by parameter name (zeros where none), then cleared."""
        out = {}
        for name, p in self.lm.named_parameters():
            out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            p.grad = None
        count("gradients", "out", out)
        return out

    def apply_step(self, grads: Sequence[Mapping[str, torch.Tensor]], total: float,
                   version: int) -> int:
        """One optimizer step with ``Σ grads / total`` (summed in the given order): the
        object-store reduction (``cells/reduce.py``), the fallback of :meth:`reduce_step`.

        Args:
            grads: the participants' :meth:`take_gradients` (values or object refs), in cell
                order.
            total: the step's normalizer (Σ chunk weights; > 0).
            version: the version the step produces (must be this learner's version + 1).

        Returns:
            The new version.
        """
        grads = [ray.get(g) if isinstance(g, ray.ObjectRef) else g for g in grads]
        count("gradients", "in", grads)
        self._check_next("apply_step", version)
        start = time.perf_counter()
        for name, p in self.lm.named_parameters():
            g = grads[0][name].clone()
            for other in grads[1:]:
                g += other[name]
            p.grad = g / total
        return self._step(total, version, start)

    def reduce_step(self, group: Any, total: float, version: int) -> int:
        """:meth:`apply_step` with the gradient summed over the step's members by an
        all-reduce over ``group`` (``cells.collectives.PeerGroup``; every member calls it;
        None: the step's only member).

        Raises:
            Exception: the collective failed or timed out; the local gradient is untouched
                (the group falls back to ``take_gradients`` + :meth:`apply_step`).
        """
        from ray_xlong.cells.collectives import reduce_gradients

        self._check_next("reduce_step", version)
        start = time.perf_counter()
        device = next(self.lm.parameters()).device
        reduce_gradients(self.lm, self, None if group is None else group.spec(0, device), total)
        return self._step(total, version, start)

    def _check_next(self, call: str, version: int) -> None:
        if version != self.version + 1:
            raise RuntimeError(f"XLongLearner.{call}: learner at version {self.version} "
                               f"cannot produce version {version} (reload its state first)")

    def _step(self, total: float, version: int, start: float) -> int:
        """Clip, one optimizer step on the gradients in place, stats; the new version."""
        params = list(self.lm.parameters())
        if self.settings.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        self.get_optimizer().step()
        self.get_optimizer().zero_grad(set_to_none=True)
        self._note_step(apply_s=time.perf_counter() - start, grad_norm=float(norm),
                        total=float(total))
        self.version = version
        return version

    # -- state ---------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The LM's state dict (detached copies), what engines load."""
        out = {k: v.detach().clone() for k, v in self.lm.state_dict().items()}
        count("weights", "out", out)
        return out

    def send_weights(self, spec: Any, version: int) -> int:
        """Broadcast this learner's weights of ``version`` to the runners of ``spec``'s sync
        group (``cells/broadcast.py``; this learner is its rank 0). Returns bytes sent."""
        from ray_xlong.cells.weight_sync import sync_groups

        if version != self.version:
            raise RuntimeError(f"XLongLearner.send_weights: learner at version {self.version}, "
                               f"asked to send version {version}")
        # the live tensors, not get_weights()'s clones: send() copies them into its buckets
        # and this actor runs nothing else meanwhile
        weights = {k: v.detach() for k, v in self.lm.state_dict().items()}
        return sync_groups(self).send(spec, weights, version)

    def get_xlong_state(self) -> dict[str, Any]:
        """Weights + optimizer state + version, whole (a checkpoint; a joining learner gets
        the state from a peer instead: :meth:`send_state`)."""
        out = {"weights": self.get_weights(), "version": self.version,
               "optimizer": self.get_optimizer().state_dict()}
        count("state", "out", out["optimizer"])
        return out

    def set_xlong_state(self, state: Mapping[str, Any]) -> int:
        """Load :meth:`get_xlong_state` output; returns the version."""
        count("state", "in", state)
        self.lm.load_state_dict(state["weights"])
        self.get_optimizer().load_state_dict(state["optimizer"])
        for p in self.lm.parameters():
            p.grad = None
        self.version = int(state["version"])
        return self.version

    # -- durable state: sharded checkpoints, export (cells/shard_checkpoint.py) -------------------
    def _checkpointer(self) -> Any:
        from ray_xlong.cells.shard_checkpoint import ShardCheckpointer

        if getattr(self, "_ckpt", None) is None:
            self._ckpt = ShardCheckpointer()
        return self._ckpt

    def save_checkpoint(self, path: str, files: Mapping[str, bytes] | None = None,
                        block: bool = False) -> str:
        """A DCP checkpoint of this Learner's state (weights, Adam, version) at ``path``,
        written in the background (``block``: before returning); ``files`` (name → bytes: the
        driver's records) land in ``path``'s parent once it is on disk. Returns ``path``."""
        return self._checkpointer().save(
            path, self.lm, self.get_optimizer(), version=self.version,
            meta={"model_dir": str(self.settings.model_dir), "dtype": self.settings.dtype},
            files=files, block=block)

    def wait_checkpoint(self) -> str | None:
        """Block until the checkpoint in flight is written; its path (None: none)."""
        return self._checkpointer().wait()

    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` checkpoint; returns its version."""
        opt = self.get_optimizer()
        self.version = self._checkpointer().load(path, self.lm, opt,
                                                 reset_optimizer=opt.state.clear)
        return self.version

    def export_hf(self, out: str) -> str:
        """Write the current weights as a Hugging Face directory (``models/export.py``): the
        safetensors, config and tokenizer of the model directory. Returns ``out``."""
        from ray_xlong.models.export import write_hf_dir

        write_hf_dir(out, self.lm.state_dict().items(), model_dir=self.settings.model_dir)
        return str(out)

    def wake_up(self, state: Any = None, after: Any = None) -> int:
        """Take the cell's GPU share back; load ``state`` if it differs in version: a
        :meth:`get_xlong_state` value, or a ``cells.collectives.StateFrom`` (the state comes
        from a holder's :meth:`send_state`, peer to peer). ``after`` is ignored: passing the
        engine's sleep ref makes Ray run this once the engine slept. Returns the version."""
        from ray_xlong.cells.collectives import StateFrom, receive_state

        self.asleep = False
        if isinstance(state, StateFrom):
            if state.version != self.version:
                device = next(self.lm.parameters()).device
                receive_state(self.lm, self.get_optimizer(), self,
                              state.group.spec(0, device), state.version)
                self.version = state.version
        elif state is not None and int(state["version"]) != self.version:
            self.set_xlong_state(state)
        return self.version

    def send_state(self, transfer: Any) -> int:
        """Send this learner's weights and optimizer state to the joiner of ``transfer``
        (a ``cells.collectives.StateFrom`` of this learner's version). Returns bytes sent."""
        from ray_xlong.cells.collectives import send_state

        if transfer.version != self.version:
            raise RuntimeError(f"XLongLearner.send_state: learner at version {self.version}, "
                               f"asked to send version {transfer.version}")
        device = next(self.lm.parameters()).device
        return send_state(self.lm, self.get_optimizer(), self,
                          transfer.group.spec(0, device), transfer.version)

    def traffic(self) -> dict[str, int]:
        """Bytes this process moved by kind (``cells.collectives.traffic``)."""
        from ray_xlong.cells.collectives import traffic

        return dict(traffic)

    def sleep(self) -> None:
        """Lend the cell's memory to the engine: drop gradients (on a GPU host the weights and
        optimizer state would be offloaded too; on CPU there is nothing else to free)."""
        for p in self.lm.parameters():
            p.grad = None
        self.asleep = True

    def _note_step(self, *, loss: LossStats = LossStats(), train_s: float = 0.0,
                   apply_s: float = 0.0, grad_norm: float | None = None,
                   total: float | None = None) -> None:
        """Add to the :class:`LearnerStepStats` of the version being trained."""
        self.step_stats.note(self.version, loss=loss, train_s=train_s, apply_s=apply_s,
                             grad_norm=grad_norm, total=total)

    def take_step_stats(self, version: int) -> LearnerStepStats | None:
        """What this learner did for the step that trained ``version`` (None if it took no
        part); forgets it and anything older."""
        return self.step_stats.take(version)


def run_pipeline(pipeline: Any, run_ids: Sequence[str], advantages: Sequence[float],
                 payloads: Sequence[Sequence[Any]], *, rl_module: Any, metrics: Any,
                 who: str) -> dict[str, torch.Tensor]:
    """One micro-batch through a Learner connector ``pipeline``: the episodes of ``run_ids``
    (found in ``payloads``) with their ``advantages`` → the default module's batch tensors.

    Raises:
        ValueError: naming ``who`` and the runs the payloads lack.
    """
    wanted = dict(zip(run_ids, advantages))
    episodes = {e.id_: e for p in payloads for e in p if e.id_ in wanted}
    missing = sorted(set(wanted) - set(episodes))
    if missing:
        raise ValueError(f"{who}: payloads lack runs {missing}")
    batch = pipeline(rl_module=rl_module, batch={}, episodes=[episodes[r] for r in run_ids],
                     shared_data={ADVANTAGES_KEY: wanted}, metrics=metrics)
    return batch[DEFAULT_MODULE_ID]


class ConnectorBatches:
    """A sharded rank's ``batch_of`` (``cells.sharded.BatchOf``): the Learner connector
    pipeline an :class:`XLongLearner` of the same ``config`` runs — the user's pieces, then
    ``PrefixTreeConnector`` — built once on the rank from ``config`` (as ``TorchLearner.build``
    does). The rank holds no RLModule (its model is FSDP-sharded): pieces get
    ``rl_module=None``; a piece that reads the module needs unsharded cells."""

    def __init__(self, config: Any) -> None:
        """Args: the ``AlgorithmConfig`` of :func:`learner_config`."""
        self.config = config
        self.pipeline: Any = None

    def __call__(self, run_ids: Sequence[str], advantages: Sequence[float],
                 payloads: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
        from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

        from ray_xlong.rllib.episodes import RUN_ACTION_SPACE, RUN_OBSERVATION_SPACE

        if self.pipeline is None:
            self.pipeline = self.config.build_learner_connector(RUN_OBSERVATION_SPACE,
                                                                RUN_ACTION_SPACE)
            self.metrics = MetricsLogger()
        return run_pipeline(self.pipeline, run_ids, advantages, payloads, rl_module=None,
                            metrics=self.metrics, who="LearnerRank.accumulate_runs")


def learner_config(settings: LearnerSettings, *, seed: int = 0,
                   processor: ProcessorConfig = ProcessorConfig(),
                   learner_connector: Callable[..., Any] | None = None):
    """The ``AlgorithmConfig`` and ``RLModuleSpec`` an :class:`XLongLearner` is built from.

    Args:
        settings: model, optimizer, loss, attention.
        seed: RLlib's seed.
        processor: the ``PrefixTreeConnector``'s configuration (layout, K, normalisation).
        learner_connector: the user's ``AlgorithmConfig.learners(learner_connector=...)``
            builder (``(obs_space, act_space) -> piece | [pieces]``); its pieces run first,
            then ``PrefixTreeConnector`` (RLlib's order: custom pieces, then the batch builder).

    Returns:
        ``(config, module_spec)``: ``XLongLearner(config=config, module_spec=spec).build()``.
    """
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from ray_xlong.rllib.episodes import RUN_ACTION_SPACE, RUN_OBSERVATION_SPACE

    config = (AlgorithmConfig()
              .framework("torch")
              .training(lr=settings.lr)
              .learners(num_learners=0, num_gpus_per_learner=0,
                        learner_config_dict={"xlong": settings},
                        learner_connector=functools.partial(
                            learner_pipeline, user=learner_connector, processor=processor),
                        add_default_connectors_to_learner_pipeline=False)
              .debugging(seed=seed))
    spec = MultiRLModuleSpec(rl_module_specs={DEFAULT_MODULE_ID: RLModuleSpec(
        module_class=XLongModule, observation_space=RUN_OBSERVATION_SPACE,
        action_space=RUN_ACTION_SPACE,
        model_config={"model_dir": settings.model_dir, "dtype": settings.dtype,
                      "attn_implementation": settings.model_attention})})
    return config, spec


def learner_pipeline(input_observation_space: Any, input_action_space: Any, *,
                     user: Callable[..., Any] | None,
                     processor: ProcessorConfig) -> list[ConnectorV2]:
    """The Learner connector pieces of a cell's Learner: ``user(obs, act)``'s pieces (a piece or
    a list), then :class:`PrefixTreeConnector` (which builds the module batch)."""
    pieces = [] if user is None else user(input_observation_space, input_action_space)
    pieces = [pieces] if isinstance(pieces, ConnectorV2) else list(pieces)
    return [*pieces, PrefixTreeConnector(input_observation_space, input_action_space,
                                         config=processor)]
