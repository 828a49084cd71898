"""A training cell's Learner as ranks of one process group, sharded with FSDP2.

```
ShardedCell (the driver-side handle, ``cells/sharded_cell.py``)
  rank 0 … R-1 = LearnerRank actors, one per bundle (per GPU on CUDA), in the cell's PG
  setup:       rank 0's address ─► init_process_group(gloo | nccl) on every rank (Ray Train's
               torch backend helpers) ─► load model ─► fully_shard(each decoder layer, root)
  accumulate_runs: every rank runs the micro-batch's episodes through the Learner connector
               pipeline the single Learner runs (the user's pieces, then PrefixTreeConnector:
               the ``batch_of`` callable the RLlib adapter hands in), then
  accumulate:  every rank takes rows r ≡ rank (mod R) of the micro-batch (a rank without rows
               runs row 0 with zero loss scale: FSDP needs every rank in every collective);
               with LearnerSettings.context_parallel = cp, groups of cp ranks split their rows
               by token ranges instead (``cells/context_parallel.py``);
               reduce-scatter SUMS (divide factor 1) into each rank's gradient shard
  take_gradients: all-gather the full gradient; rank 0's copy is the cell's
  apply_step:  Σ parts / total, each rank keeps its shard (no communication), Adam on shards
  state:       full (unsharded) weights + optimizer state, rank 0's copy (DCP state_dict)
  sleep:       gradients dropped; on CUDA the parameter shards and Adam's state go to host
               memory (``move_training_state``) and the allocator's cache is emptied, so the
               cell's engines find the GPU free (vLLM checks free memory when it builds or
               wakes); wake_up moves them back before anything else runs
placement:     ``sharding.rank_placements`` (each rank holds its bundle's Ray GPUs; CUDA: one
               device per rank, NCCL; CPU: gloo, so logical GPUs never lead to NCCL)
```

Across cells nothing changes: a cell's gradient is one ``{name: tensor}`` like a single
Learner's, so the elastic reduction and its membership invariance hold (DESIGN.md 7). Every
call goes to every rank in the same order (the collectives match).

``LearnerRank`` itself needs no Ray (Ray is imported where a call needs it): the torch-only
device check (``benchmarks/gpu_check.py --torch-only``) runs it in a plain process.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ray_xlong.cells.collectives import count, gathered
from ray_xlong.cells.context_parallel import make_groups, rank_share
from ray_xlong.cells.learner_settings import LearnerSettings
from ray_xlong.cells.sharding import ShardingError, ShardingSettings
from ray_xlong.trajectory.loss import policy_loss
from ray_xlong.trajectory.loss_stats import LearnerStepStats, StepStatsLog, loss_stats
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import PackedBatch, _take_rows

BatchOf = Callable[[Sequence[str], Sequence[float], Sequence[Any]], Mapping[str, torch.Tensor]]
"""``batch_of(run_ids, advantages, payloads) -> module-batch tensors``: the Learner connector
pipeline a rank runs a micro-batch's episodes through (raises naming runs the payloads lack)."""


class LearnerRank:
    """One rank of a sharded cell Learner (a Ray actor; see the module docstring)."""

    def __init__(self, *, settings: LearnerSettings, sharding: ShardingSettings, rank: int,
                 world_size: int, batch_of: BatchOf | None = None) -> None:
        """Args: see :func:`start_sharded_cell` (``rank`` of ``world_size``)."""
        self.settings, self.sharding, self.batch_of = settings, sharding, batch_of
        self.rank, self.world_size = rank, world_size
        self.version, self.asleep, self.micro_batches, self.tokens = 0, False, 0, 0
        self.step_stats = StepStatsLog()
        self.device = torch.device("cuda", 0) if sharding.device == "cuda" else torch.device("cpu")
        self.offload_to = torch.device("cpu")
        """Where :meth:`sleep` moves the training state (nowhere when it is ``device``)."""
        self.sleep_memory: dict[str, int] = {}
        """Device bytes allocated before / after the last sleep and after its wake-up
        (``before_sleep``, ``asleep``, ``awake``; 0 off CUDA)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0 hosts the rendezvous)."""
        from ray.train._internal.utils import get_address_and_port

        return get_address_and_port()

    def setup(self, addr: str, port: int) -> int:
        """Join the cell's process group, load and shard the model, build Adam. Returns the
        rank."""
        if self.device.type == "cuda":
            if not torch.cuda.is_available():   # logical GPUs only: never try NCCL
                raise ShardingError(f"ShardingSettings.device='cuda' but rank {self.rank} sees no "
                                    f"CUDA device (torch.cuda.is_available() is False): use "
                                    f"device='cpu' on hosts without CUDA")
            torch.cuda.set_device(self.device)
        _init_process_group(self.sharding, rank=self.rank, world_size=self.world_size,
                            init_method=f"tcp://{addr}:{port}")
        self.cp_group = self._context_group()
        self.root = _sharded_model(self.settings, self.sharding, self.device, self.world_size)
        self.lm = self.root.lm
        self.opt = torch.optim.Adam(self.lm.parameters(), lr=self.settings.lr)
        return self.rank

    def build(self) -> int:
        """Ready probe (the cell pool calls ``build`` on a learner): raises until set up."""
        if not hasattr(self, "lm"):
            raise RuntimeError(f"LearnerRank.build: rank {self.rank} is not set up")
        return self.rank

    def accumulate_runs(self, run_ids: Sequence[str], advantages: Sequence[float],
                        version: int | None, *payloads: Sequence[Any]) -> int:
        """``XLongLearner.accumulate_runs`` on this rank: the runs ``run_ids`` (episodes in
        ``payloads``) with their group-wide ``advantages`` go through the Learner connector
        pipeline (``batch_of``: the user's pieces, then PrefixTreeConnector, un-normalised),
        then :meth:`accumulate` trains this rank's rows. Returns their targets."""
        if self.batch_of is None:
            raise RuntimeError("LearnerRank.accumulate_runs: no batch_of pipeline was handed in "
                               "(start_sharded_cell(batch_of=...))")
        self._check("accumulate_runs", version)
        return self.accumulate(self.batch_of(run_ids, advantages, payloads), version)

    def accumulate(self, micro_batch: Mapping[str, torch.Tensor],
                   version: int | None = None) -> int:
        """Forward + backward this rank's rows of ``micro_batch``; returns their targets."""
        self._check("accumulate", version)
        batch = PackedBatch.from_tensors(micro_batch)
        plan = None
        if self.settings.context_parallel > 1:
            mine, plan, targets = rank_share(batch, rank=self.rank, world_size=self.world_size,
                                             context_parallel=self.settings.context_parallel,
                                             group=self.cp_group)
        else:
            mine, targets = rank_rows(batch, rank=self.rank, world_size=self.world_size)
        mine = PackedBatch.from_tensors({k: v if k in ("run_ids", "layout") else
                                         v.to(self.device)
                                         for k, v in mine.to_tensors().items()})
        start = time.perf_counter()
        logprobs = self.root(mine.to_tensors(), plan)
        loss, _ = policy_loss(logprobs, mine, self.settings.loss)
        loss.backward()
        self.step_stats.note(self.version, loss=loss_stats(logprobs, mine, self.settings.loss,
                                                           loss=float(loss)),
                             train_s=time.perf_counter() - start)
        self.micro_batches += 1
        self.tokens += targets
        return targets

    def _context_group(self) -> Any:
        """This rank's context-parallel process group (None without context parallelism)."""
        if self.settings.context_parallel == 1:
            return None
        return make_groups(self.world_size, self.settings.context_parallel, self.rank)

    def _check(self, call: str, version: int | None) -> None:
        if self.asleep:
            raise RuntimeError(f"LearnerRank.{call}: the learner is asleep (wake_up first)")
        if version is not None and version != self.version:
            raise RuntimeError(f"LearnerRank.{call}: rank at version {self.version}, the step "
                               f"trains version {version} (reload its state first)")

    def take_gradients(self) -> dict[str, torch.Tensor] | None:
        """The cell's summed gradient, unsharded (rank 0; None on the others), then cleared:
        the object-store fallback only (:meth:`reduce_step` never gathers it)."""
        out = {}
        for name, p in self.lm.named_parameters():
            g = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
            out[name] = g.detach().to("cpu", copy=True)
            p.grad = None
        gathered(self.lm, "gradients")
        if self.rank != 0:
            return None
        count("gradients", "out", out)
        return out

    def apply_step(self, grads: Sequence[Any], total: float, version: int) -> int:
        """One Adam step on this rank's shards with ``Σ grads / total`` (see XLongLearner): the
        object-store reduction's fallback path (full gradients in, each rank keeps its
        shard)."""
        from torch.distributed.tensor import distribute_tensor

        ray = sys.modules.get("ray")        # no Ray imported: no refs to fetch
        if ray is not None:
            grads = [ray.get(g) if isinstance(g, ray.ObjectRef) else g for g in grads]
        count("gradients", "in", grads)
        self._check_next("apply_step", version)
        for name, p in self.lm.named_parameters():
            g = grads[0][name].clone()
            for other in grads[1:]:
                g += other[name]
            g = (g / total).to(self.device, p.dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        return self._step(version, total)

    def reduce_step(self, group: Any, total: float, version: int) -> int:
        """This rank's gradient shard all-reduced with rank ``rank`` of the step's other member
        cells over ``group`` (``cells.collectives``: no full gradient anywhere), ÷ ``total``,
        one Adam step on the shards. The cell's ranks first agree that every one of them
        reduced (a MIN over the cell's own group), so a cell applies on all ranks or none.

        Raises:
            RuntimeError: a rank's collective failed or timed out; every rank's gradient is
                untouched (the group falls back to ``take_gradients`` + :meth:`apply_step`).
        """
        import torch.distributed as dist

        from ray_xlong.cells.collectives import reduce_gradients

        self._check_next("reduce_step", version)
        shards = {n: p.grad for n, p in self.lm.named_parameters()}
        error = None
        try:
            spec = None if group is None else group.spec(self.rank, self.device)
            reduce_gradients(self.lm, self, spec, total)
        except Exception as exc:  # noqa: BLE001 - reported to the cell's ranks, then raised
            error = exc
        ok = torch.tensor([0.0 if error else 1.0], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if float(ok) < 1.0:
            for name, p in self.lm.named_parameters():   # a rank that reduced puts its own back
                p.grad = shards[name]
            raise RuntimeError(f"LearnerRank.reduce_step: rank {self.rank}: the cell's "
                               f"collective failed ({error or 'on another rank'})")
        return self._step(version, total)

    def _check_next(self, call: str, version: int) -> None:
        if version != self.version + 1:
            raise RuntimeError(f"LearnerRank.{call}: rank at version {self.version} cannot "
                               f"produce version {version} (reload its state first)")

    def _step(self, version: int, total: float) -> int:
        """Clip, Adam on the shards' gradients, the new version. Collective (the norm)."""
        start = time.perf_counter()
        params = list(self.lm.parameters())
        if self.settings.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_stats.note(self.version, apply_s=time.perf_counter() - start,
                             grad_norm=float(norm), total=float(total))
        self.version = version
        return version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU (rank 0; ``{}`` on the others). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out = get_model_state_dict(self.lm, options=full)
        gathered(self.lm, "weights")
        if self.rank == 0:
            count("weights", "out", out)
        return out

    def send_weights(self, spec: Any, version: int) -> int:
        """Gather the full weights (collective) and broadcast them from rank 0 to the runners
        of ``spec``'s sync group (``cells/broadcast.py``). Returns bytes sent (0 off rank 0)."""
        from ray_xlong.cells.weight_sync import sync_groups

        if version != self.version:
            raise RuntimeError(f"LearnerRank.send_weights: rank at version {self.version}, "
                               f"asked to send version {version}")
        weights = self.get_weights()
        if self.rank != 0:
            return 0
        return sync_groups(self).send(spec, weights, version)

    def get_xlong_state(self) -> dict[str, Any]:
        """Full weights + optimizer state + version (rank 0's is complete). Collective."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Before the first step Adam has no state, and DCP would create it with a zero-grad
        # step (Adam's step count +1, a different bias correction): say "fresh" instead.
        optimizer = (get_optimizer_state_dict(self.lm, self.opt, options=full)
                     if self.opt.state else None)
        return {"weights": self.get_weights(), "version": self.version, "optimizer": optimizer}

    def set_xlong_state(self, state: Mapping[str, Any]) -> int:
        """Load a full :meth:`get_xlong_state` (every rank gets the whole state, keeps its
        shards)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        count("state", "in", state)
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.lm, state["weights"], options=full)
        if state["optimizer"] is None:
            self.opt = torch.optim.Adam(self.lm.parameters(), lr=self.settings.lr)
        else:
            set_optimizer_state_dict(self.lm, self.opt, state["optimizer"], options=full)
        for p in self.lm.parameters():
            p.grad = None
        self.version = int(state["version"])
        return self.version

    # -- durable state: each rank its shards (cells/shard_checkpoint.py) ---------------------
    def _checkpointer(self) -> Any:
        from ray_xlong.cells.shard_checkpoint import ShardCheckpointer

        if getattr(self, "_ckpt", None) is None:
            import torch.distributed as dist

            # its own gloo group: the async save's collectives run beside the training ones
            self._ckpt = ShardCheckpointer(rank=self.rank,
                                           group=lambda: dist.new_group(backend="gloo"))
        return self._ckpt

    def save_checkpoint(self, path: str, files: Mapping[str, bytes] | None = None,
                        block: bool = False) -> str:
        """A DCP checkpoint of this rank's shards (weights, Adam) at ``path`` (every rank
        calls it; written in the background unless ``block``); rank 0 writes ``files`` into
        ``path``'s parent once every shard is on disk. Returns ``path``."""
        return self._checkpointer().save(
            path, self.lm, self.opt, version=self.version,
            meta={"model_dir": str(self.settings.model_dir), "dtype": self.settings.dtype,
                  "ranks": self.world_size},
            files=files, block=block)

    def wait_checkpoint(self) -> str | None:
        """Block until this rank's checkpoint in flight is written; its path (None: none)."""
        return self._checkpointer().wait()

    def load_checkpoint(self, path: str) -> int:
        """Every rank loads its shards of a checkpoint (any rank count wrote it: DCP reshards).
        Returns its version."""
        def fresh() -> None:
            self.opt = torch.optim.Adam(self.lm.parameters(), lr=self.settings.lr)

        self.version = self._checkpointer().load(path, self.lm, self.opt, reset_optimizer=fresh)
        return self.version

    def export_hf(self, out: str) -> str:
        """Rank 0 writes a Hugging Face directory (``models/export.py``); each tensor is
        gathered from the ranks' shards on its turn and written with its file, so no rank
        holds the whole model. Collective. Returns ``out``."""
        from ray_xlong.models.export import write_hf_dir

        def full() -> Any:
            for name, t in self.lm.state_dict().items():
                yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).to("cpu")

        if self.rank == 0:
            write_hf_dir(out, full(), model_dir=self.settings.model_dir)
        else:
            for _ in full():
                pass
        return str(out)

    def wake_up(self, state: Any = None, after: Any = None) -> int:
        """Awake: the training state back on the device, then ``state`` loaded if its
        version differs — a full :meth:`get_xlong_state`, or a ``cells.collectives.StateFrom``:
        this rank's shards from rank ``rank`` of a holder cell (:meth:`send_state`). Returns
        the version."""
        from ray_xlong.cells.collectives import StateFrom, receive_state

        if self.asleep and self.offload_to != self.device:
            move_training_state(self.root, self.opt, self.device)
            self.sleep_memory["awake"] = _allocated(self.device)
        self.asleep = False
        if isinstance(state, StateFrom):
            if state.version != self.version:
                receive_state(self.lm, self.opt, self, state.group.spec(self.rank, self.device),
                              state.version)
                self.version = state.version
        elif state is not None and int(state["version"]) != self.version:
            self.set_xlong_state(state)
        return self.version

    def send_state(self, transfer: Any) -> int:
        """Send this rank's parameter and Adam shards to rank ``rank`` of the joiner of
        ``transfer`` (a ``cells.collectives.StateFrom``). Returns bytes sent."""
        from ray_xlong.cells.collectives import send_state

        if transfer.version != self.version:
            raise RuntimeError(f"LearnerRank.send_state: rank at version {self.version}, "
                               f"asked to send version {transfer.version}")
        return send_state(self.lm, self.opt, self, transfer.group.spec(self.rank, self.device),
                          transfer.version)

    def traffic(self) -> dict[str, int]:
        """Bytes this process moved by kind (``cells.collectives.traffic``)."""
        from ray_xlong.cells.collectives import traffic

        return dict(traffic)

    def sleep(self) -> None:
        """Free the device for the cell's engines: gradients dropped; the parameter shards and
        optimizer state moved to ``offload_to`` (on CUDA: host memory) and the allocator's
        cache emptied."""
        for p in self.lm.parameters():
            p.grad = None
        if self.offload_to != self.device and not self.asleep:
            self.sleep_memory["before_sleep"] = _allocated(self.device)
            move_training_state(self.root, self.opt, self.offload_to)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.sleep_memory["asleep"] = _allocated(self.device)
        self.asleep = True

    def take_step_stats(self, version: int) -> LearnerStepStats | None:
        """This rank's part of the step that trained ``version``: its targets' loss statistics
        (its rows, or its token ranges under context parallelism), seconds, and the cell's
        gradient norm and normalizer (None: no part in it); forgets it and anything older.
        The cell's handle merges its ranks' parts (:func:`merge_rank_stats`)."""
        return self.step_stats.take(version)

    def xlong_metrics(self) -> dict[str, int]:
        """This rank's micro-batches, target tokens and version."""
        return {"micro_batches": self.micro_batches, "tokens": self.tokens,
                "version": self.version}


def move_training_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        device: torch.device) -> int:
    """Move ``module``'s parameters and buffers (FSDP2 shards: ``FSDPModule._apply`` keeps the
    sharded parameters registered, the same objects, so ``optimizer`` still holds them) and
    ``optimizer``'s state tensors (scalars stay: Adam's ``step`` lives where Adam wants it) to
    ``device``. Returns the bytes that moved."""
    moved = sum(t.numel() * t.element_size()
                for t in [*module.parameters(), *module.buffers()] if t.device != device)
    module.to(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device != device:
                moved += value.numel() * value.element_size()
                state[key] = value.to(device)
    return moved


def _allocated(device: torch.device) -> int:
    """Bytes the caching allocator has handed out on ``device`` (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _init_process_group(sharding: ShardingSettings, *, rank: int, world_size: int,
                        init_method: str) -> None:
    """``dist.init_process_group`` as Ray Train's torch backend calls it
    (``ray.train.torch.config._setup_torch_process_group``, Ray 2.60): NCCL's async error
    handling on unless the environment says otherwise, the cell's timeout; no Ray needed."""
    import datetime

    import torch.distributed as dist

    if sharding.backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend=sharding.backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=int(sharding.timeout_s)))


def rank_rows(batch: PackedBatch, *, rank: int, world_size: int) -> tuple[PackedBatch, int]:
    """Rows ``r ≡ rank (mod world_size)`` of ``batch`` and their targets; a rank left without
    rows gets row 0 with zero loss scale (it must still join the forward's collectives)."""
    rows = list(range(rank, int(batch.input_ids.shape[0]), world_size))
    if rows:
        mine = _take_rows(batch, rows)
        return mine, mine.num_targets
    mine = _take_rows(batch, [0])
    return PackedBatch.from_tensors({**mine.to_tensors(),
                                     "loss_scale": torch.zeros_like(mine.loss_scale)}), 0


class _TokenLogprobs(torch.nn.Module):
    """The FSDP root: ``forward(batch tensors) = token_logprobs(lm, batch)``. ``token_logprobs``
    calls the decoder and the output head separately (logits only at targets), so the LM
    itself is never called and its root hooks would never gather the embedding / head."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tensors: dict[str, torch.Tensor], plan: Any = None) -> torch.Tensor:
        # a fresh tensor, not a view: FSDP's pre-backward hook sits on the root's output
        return token_logprobs(self.lm, PackedBatch.from_tensors(tensors), plan=plan).clone()


def _sharded_model(settings: LearnerSettings, sharding: ShardingSettings, device: torch.device,
                   world_size: int) -> _TokenLogprobs:
    """Load the LM, optionally checkpoint activations, ``fully_shard`` each decoder layer and
    the root (embedding, norm, head) over a 1-D mesh of the cell's ranks; gradients reduce as
    sums."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from ray_xlong.models import load_model
    from ray_xlong.trajectory.tree_attention import ATTN_IMPLEMENTATION, register

    if settings.model_attention == ATTN_IMPLEMENTATION:
        register()
    # LearnerSettings.dtype names a torch dtype (cells.learner_settings.DTYPES)
    lm = load_model(settings.model_dir, dtype=getattr(torch, settings.dtype),
                    attn_implementation=settings.model_attention).to(device)
    lm.train()
    if sharding.activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if sharding.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    for layer in _decoder_layers(lm):
        fully_shard(layer, **kwargs)
    root = fully_shard(_TokenLogprobs(lm), **kwargs)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)   # sums, as the elastic reduction expects
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo: no PREMUL_SUM)
    return root


def _decoder_layers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The HF decoder layers (``model.layers``), or [] when the model has none by that name."""
    inner = getattr(lm, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []
