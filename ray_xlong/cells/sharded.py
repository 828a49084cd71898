"""A training cell's Learner as ranks of one process group, sharded with FSDP2.

```
ShardedCell (driver-side handle; answers the learner calls ElasticLearnerGroup makes)
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
placement:     ``sharding.rank_placements`` (CUDA: one device per rank, NCCL; CPU: gloo, no GPU
               asked for, so logical GPUs never lead to NCCL)
```

Across cells nothing changes: a cell's gradient is one ``{name: tensor}`` like a single
Learner's, so the elastic reduction and its membership invariance hold (DESIGN.md 7). Every
call goes to every rank in the same order (the collectives match); the handle returns rank 0's
ref, or a ref that fails as soon as any rank failed (a rank lost mid-step fails the cell's
call at once, not after the survivors' collective times out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import ray
import torch

from ray_xlong.cells.context_parallel import make_groups, rank_share
from ray_xlong.cells.sharding import ShardingError, ShardingSettings, rank_placements
from ray_xlong.trajectory.loss import policy_loss
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import PackedBatch, _take_rows

if TYPE_CHECKING:  # config.py imports pool.py, which imports this module
    from ray_xlong.cells.config import LearnerSettings

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
        self.device = torch.device("cuda", 0) if sharding.device == "cuda" else torch.device("cpu")

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0 hosts the rendezvous)."""
        from ray.train._internal.utils import get_address_and_port

        return get_address_and_port()

    def setup(self, addr: str, port: int) -> int:
        """Join the cell's process group, load and shard the model, build Adam. Returns the
        rank."""
        from ray.train.torch.config import _setup_torch_process_group

        if self.device.type == "cuda":
            if not torch.cuda.is_available():   # logical GPUs only: never try NCCL
                raise ShardingError(f"ShardingSettings.device='cuda' but rank {self.rank} sees no "
                                    f"CUDA device (torch.cuda.is_available() is False): use "
                                    f"device='cpu' on hosts without CUDA")
            torch.cuda.set_device(self.device)
        _setup_torch_process_group(backend=self.sharding.backend, world_rank=self.rank,
                                   world_size=self.world_size, init_method=f"tcp://{addr}:{port}",
                                   timeout_s=int(self.sharding.timeout_s))
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
        loss, _ = policy_loss(self.root(mine.to_tensors(), plan), mine, self.settings.loss)
        loss.backward()
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
        """The cell's summed gradient, unsharded (rank 0; None on the others), then cleared."""
        out = {}
        for name, p in self.lm.named_parameters():
            g = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
            out[name] = g.detach().to("cpu", copy=True)
            p.grad = None
        return out if self.rank == 0 else None

    def apply_step(self, grads: Sequence[Any], total: float, version: int) -> int:
        """One Adam step on this rank's shards with ``Σ grads / total`` (see XLongLearner)."""
        from torch.distributed.tensor import distribute_tensor

        grads = [ray.get(g) if isinstance(g, ray.ObjectRef) else g for g in grads]
        if version != self.version + 1:
            raise RuntimeError(f"LearnerRank.apply_step: rank at version {self.version} cannot "
                               f"produce version {version} (reload its state first)")
        for name, p in self.lm.named_parameters():
            g = grads[0][name].clone()
            for other in grads[1:]:
                g += other[name]
            g = (g / total).to(self.device, p.dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(self.lm.parameters()), self.settings.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version = version
        return version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU (rank 0; ``{}`` on the others). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.lm, options=full)

    def send_weights(self, spec: Any, version: int) -> int:
        """Gather the full weights (collective) and broadcast them from rank 0 to the runners
        of ``spec``'s sync group (``cells/broadcast.py``). Returns bytes sent (0 off rank 0)."""
        from ray_xlong.cells.weight_sync import SyncGroups

        if version != self.version:
            raise RuntimeError(f"LearnerRank.send_weights: rank at version {self.version}, "
                               f"asked to send version {version}")
        weights = self.get_weights()
        if self.rank != 0:
            return 0
        if not hasattr(self, "_sync_groups"):
            self._sync_groups = SyncGroups()
        return self._sync_groups.send(spec, weights, version)

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

    def wake_up(self, state: Mapping[str, Any] | None = None, after: Any = None) -> int:
        """Awake; load ``state`` if its version differs. Returns the version."""
        self.asleep = False
        if state is not None and int(state["version"]) != self.version:
            self.set_xlong_state(state)
        return self.version

    def sleep(self) -> None:
        """Drop gradients (and on CUDA the allocator's cache) so the engine gets the memory."""
        for p in self.lm.parameters():
            p.grad = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def take_step_stats(self, version: int) -> None:
        """No per-step Learner statistics on a sharded rank yet (``collect_learner_stats``
        leaves the cell out of the step's learner metrics)."""
        return None

    def xlong_metrics(self) -> dict[str, int]:
        """This rank's micro-batches, target tokens and version."""
        return {"micro_batches": self.micro_batches, "tokens": self.tokens,
                "version": self.version}


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

    from ray_xlong.cells.config import DTYPES
    from ray_xlong.models import load_model
    from ray_xlong.trajectory.tree_attention import ATTN_IMPLEMENTATION, register

    if settings.model_attention == ATTN_IMPLEMENTATION:
        register()
    lm = load_model(settings.model_dir, dtype=DTYPES[settings.dtype],
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


@ray.remote(num_cpus=0)
def _first(refs: list[Any]) -> Any:
    """Rank 0's value once every rank's call succeeded; fails with the first rank that fails,
    as soon as it fails (the refs arrive in a list, so Ray does not wait for all of them)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])
    return ray.get(refs[0])


class _Method:
    """``handle.name.remote(*args)``: call ``name`` on every rank in order; one ref back."""

    def __init__(self, ranks: Sequence[Any], name: str, *, wait_all: bool) -> None:
        self.ranks, self.name, self.wait_all = ranks, name, wait_all

    def remote(self, *args: Any) -> Any:
        refs = [getattr(r, self.name).remote(*args) for r in self.ranks]
        return _first.remote(refs) if self.wait_all else refs[0]


class ShardedCell:
    """A cell's Learner ranks behind the one-learner interface (``CellActors`` contract):
    ``accumulate_runs`` / ``accumulate`` / ``take_gradients`` / ``apply_step`` / ``get_weights`` /
    ``get_xlong_state`` / ``set_xlong_state`` / ``wake_up`` / ``sleep`` / ``build`` go to every
    rank; the ref returned is rank 0's (for state and gradients, which rank 0 alone holds
    whole) or one that fails when any rank failed (steps, loads)."""

    _RANK0 = ("take_gradients", "get_weights", "get_xlong_state")
    _ALL = ("accumulate", "accumulate_runs", "apply_step", "set_xlong_state", "wake_up",
            "sleep", "build", "xlong_metrics", "take_step_stats", "send_weights",
            "__ray_ready__")

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = list(ranks)
        for name in self._RANK0:
            setattr(self, name, _Method(self.ranks, name, wait_all=False))
        for name in self._ALL:
            setattr(self, name, _Method(self.ranks, name, wait_all=True))

    def __len__(self) -> int:
        return len(self.ranks)

    def kill(self) -> None:
        """Stop every rank."""
        for r in self.ranks:
            ray.kill(r, no_restart=True)


def kill(actor: Any) -> None:
    """``ray.kill(actor, no_restart=True)``, or every rank of a :class:`ShardedCell`."""
    if isinstance(actor, ShardedCell):
        actor.kill()
    else:
        ray.kill(actor, no_restart=True)


def start_sharded_cell(*, pg: Any, settings: LearnerSettings, sharding: ShardingSettings,
                       nodes_per_cell: int, gpus_per_node: int,
                       held_gpu_ids: Sequence[Sequence[str]] = (),
                       cpus_per_rank: float = 0.0,
                       batch_of: BatchOf | None = None) -> ShardedCell:
    """Start ``sharding.ranks_per_cell`` ranks on the bundles of ``pg`` (the same number on
    each, placed by ``sharding.rank_placements``: on CUDA one device per rank, the ranks of a
    bundle whose GPUs the rollout side holds pinned to ``held_gpu_ids`` of that bundle), form
    their process group and shard the model. Returns at once: ``handle.build.remote()``
    resolves when every rank is set up.
    ``batch_of(run_ids, advantages, payloads)`` → module-batch tensors is the Learner connector
    pipeline ``accumulate_runs`` runs (the RLlib adapter hands in
    ``rllib.learner.ConnectorBatches``: this package imports no RLlib).

    Raises:
        ShardingError: the layout cannot host the ranks (``sharding.rank_placements``).
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = sharding.ranks_per_cell
    places = rank_placements(sharding, nodes_per_cell=nodes_per_cell,
                             gpus_per_node=gpus_per_node, held_gpu_ids=held_gpu_ids)
    ranks = []
    for p in places:
        env = {} if p.visible_devices is None else {
            "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": p.visible_devices}}}
        ranks.append(ray.remote(LearnerRank).options(
            num_cpus=cpus_per_rank, num_gpus=p.num_gpus, **env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=p.bundle) if pg is not None else "DEFAULT",
        ).remote(settings=settings, sharding=sharding, rank=p.rank, world_size=world,
                 batch_of=batch_of))
    addr, port = ray.get(ranks[0].address.remote())
    setups = [r.setup.remote(addr, port) for r in ranks]
    cell = ShardedCell(ranks)
    cell.setup_refs = setups
    return cell
