"""``ShardingSettings``: how a training cell spreads its Learner over its bundles, and the pure
checks that run before any actor starts.

```
training cell = placement group of nodes_per_cell bundles
  bundle b ─► ranks_per_cell / nodes_per_cell Learner ranks (one per GPU on CUDA)
  all ranks ─► one process group (gloo on CPU, NCCL on CUDA), FSDP2 over it, built once
              per training stint (membership inside a cell is fixed while it trains)
```

GPU placement (``rank_placements``): a cell's Learner ranks hold their bundle's GPUs in Ray's
accounting (``ray.get_gpu_ids()`` in a rank names them), on CPU as on CUDA: rank l of a bundle
of G GPUs and R ranks asks for G / R GPUs (whole GPUs when G / R >= 1, a share of one GPU when
R > G). The rollout side of the cell time-shares the same GPUs (the runner sleeps its engines
while the cell trains)::

  engines in the runner (EngineLayout.placement='process'):
  bundle b   every rank asks Ray for its G / R GPUs (Ray pins them); the runner on bundle 0
             asks for none and is pinned (``CUDA_VISIBLE_DEVICES``) to the GPUs the Learner
             holds there (``pool.py``)

  engine actors (EngineLayout.placement='actors', cells/engine_actors.py):
  bundle b   engine actors hold the bundle's GPUs (``held_gpu_ids``): every rank asks Ray for
             none and is pinned to its bundle's GPUs (rank l → GPU l · G / R)

Ray does not touch ``CUDA_VISIBLE_DEVICES`` of an actor that asks for no GPU (Ray 2.60), so the
pin set through the actor's ``runtime_env`` holds. The torch device is ``device``: on CPU the
ranks hold Ray GPUs (logical ones too) but compute on the CPU with gloo; NCCL only with
``device='cuda'``.

The checks name the field and the numbers: CUDA asked for on bundles without GPUs, a rank count
that does not split over the cell's bundles / GPUs, a model whose training state (weights,
gradients, Adam moments) does not fit the cell's ranks. Pure: no ray, no CUDA calls.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

DEVICES = ("cpu", "cuda")
"""``ShardingSettings.device`` values."""

MIXED_PRECISION = (None, "bf16")
"""``ShardingSettings.mixed_precision`` values."""

BYTES_PER_PARAM = {None: 16, "bf16": 18}
"""Training-state bytes per parameter: fp32 weights + fp32 gradients + Adam's two fp32 moments
(16), and a bf16 compute copy of the weights under mixed precision (+2, unsharded per layer, a
bound)."""


class ShardingError(ValueError):
    """A sharded cell cannot be built as configured (the message names the field and sizes)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardingSettings:
    """A training cell's Learner ranks (``sharded.py`` builds them)."""

    ranks_per_cell: int = 1
    """Learner ranks per training cell; a multiple of ``CellLayout.nodes_per_cell`` (the same
    number on every bundle). 1: today's single Learner on bundle 0."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL; needs ``CellLayout.gpus_per_node`` ≥ ranks per
    bundle)."""
    mixed_precision: str | None = None
    """None (train in ``LearnerSettings.dtype``) or ``bf16`` (FSDP2 ``MixedPrecisionPolicy``:
    bf16 compute, fp32 gradient reduction and fp32 master weights)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (HF gradient checkpointing,
    non-reentrant) to fit longer rows."""
    memory_per_rank_gb: float | None = None
    """Device memory one rank may use for its training state (None: not checked). The model
    check needs it; ``gpu_check`` fills it from the device."""
    timeout_s: float = 120.0
    """Process group timeout: a collective waiting on a lost rank fails after this long."""

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_cell, bool) or not isinstance(self.ranks_per_cell, int) \
                or self.ranks_per_cell < 1:
            raise ShardingError(f"ShardingSettings.ranks_per_cell must be an int >= 1, "
                                f"got {self.ranks_per_cell!r}")
        if self.device not in DEVICES:
            raise ShardingError(f"ShardingSettings.device must be one of {DEVICES}, "
                                f"got {self.device!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ShardingError(f"ShardingSettings.mixed_precision must be one of "
                                f"{MIXED_PRECISION}, got {self.mixed_precision!r}")
        if self.memory_per_rank_gb is not None and not self.memory_per_rank_gb > 0:
            raise ShardingError(f"ShardingSettings.memory_per_rank_gb must be > 0 or None, "
                                f"got {self.memory_per_rank_gb!r}")
        if not self.timeout_s > 0:
            raise ShardingError(f"ShardingSettings.timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def backend(self) -> str:
        """The process group backend: ``nccl`` on CUDA, ``gloo`` on CPU."""
        return "nccl" if self.device == "cuda" else "gloo"


def ranks_per_bundle(settings: ShardingSettings, *, nodes_per_cell: int,
                     gpus_per_node: int) -> int:
    """Ranks on each of a cell's bundles; validates the layout (pure).

    Raises:
        ShardingError: naming ``ShardingSettings.device`` when CUDA is asked for on bundles
            without GPUs, ``ShardingSettings.ranks_per_cell`` when it does not split evenly
            over the bundles or exceeds a bundle's GPUs.
    """
    if settings.device == "cuda" and gpus_per_node < 1:
        raise ShardingError(f"ShardingSettings.device='cuda' but the cell's bundles have no GPUs "
                            f"(CellLayout.gpus_per_node={gpus_per_node})")
    if settings.ranks_per_cell == 1:    # one unsharded Learner on the cell's first bundle
        return 1
    if settings.ranks_per_cell % nodes_per_cell:
        raise ShardingError(f"ShardingSettings.ranks_per_cell={settings.ranks_per_cell} does not "
                            f"split over CellLayout.nodes_per_cell={nodes_per_cell} bundles")
    per = settings.ranks_per_cell // nodes_per_cell
    if settings.device == "cuda" and (per > gpus_per_node or gpus_per_node % per):
        raise ShardingError(f"ShardingSettings.ranks_per_cell={settings.ranks_per_cell} puts "
                            f"{per} ranks on a bundle of CellLayout.gpus_per_node={gpus_per_node}"
                            f" GPUs (needs a divisor of it: whole GPUs per rank)")
    return per


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one Learner rank of a cell runs and what it asks Ray for."""

    rank: int
    """The rank in the cell's process group."""
    bundle: int
    """The cell's bundle (placement group bundle index) it runs in."""
    num_gpus: float
    """GPUs it asks Ray for (its bundle's G / R; 0 on a bundle without GPUs or whose GPUs the
    engine actors hold)."""
    visible_devices: str | None
    """``CUDA_VISIBLE_DEVICES`` it is started with (None: Ray's or the node's own)."""


def rank_placements(settings: ShardingSettings, *, nodes_per_cell: int, gpus_per_node: int,
                    held_gpu_ids: Sequence[Sequence[str]] = ()) -> list[RankPlacement]:
    """Every rank's :class:`RankPlacement` (pure; the module docstring draws the layout).

    Args:
        settings: the cell's ranks and device.
        nodes_per_cell, gpus_per_node: the cell's ``CellLayout``.
        held_gpu_ids: the Ray GPU ids of the cell's bundles 0 … k-1 whose GPUs the rollout
            side holds (every bundle's with engine actors; empty when the runner hosts the
            engines: the ranks hold the GPUs then): the ranks there ask for none and, on CUDA,
            are pinned to them.

    Raises:
        ShardingError: the layout cannot host the ranks (:func:`ranks_per_bundle`), or
            ``held_gpu_ids`` lists a bundle without its ``gpus_per_node`` GPUs.
    """
    per = ranks_per_bundle(settings, nodes_per_cell=nodes_per_cell, gpus_per_node=gpus_per_node)
    cuda = settings.device == "cuda"
    if any(len(ids) != gpus_per_node for ids in held_gpu_ids):
        raise ShardingError(f"ShardingSettings.device={settings.device!r}: the cell's bundles hold "
                            f"GPUs {[list(ids) for ids in held_gpu_ids]}, "
                            f"CellLayout.gpus_per_node={gpus_per_node}")
    share = gpus_per_node / per
    share = float(int(share)) if share >= 1 else share     # whole GPUs, or one GPU's share
    stride = max(gpus_per_node // per, 1)
    out = []
    for rank in range(settings.ranks_per_cell):
        bundle, local = divmod(rank, per)
        if bundle < len(held_gpu_ids):
            pin = str(held_gpu_ids[bundle][(local * stride) % gpus_per_node]) if cuda else None
            out.append(RankPlacement(rank, bundle, 0.0, pin))
        else:
            out.append(RankPlacement(rank, bundle, share, None))
    return out


def check_model_fits(settings: ShardingSettings, *, num_params: int) -> float:
    """Raise when ``num_params``' training state does not fit the cell's ranks (pure).

    Returns:
        The estimated GB per rank: ``num_params × BYTES_PER_PARAM / ranks_per_cell / 1e9``.

    Raises:
        ShardingError: naming the model size, the cell's ranks and the memory per rank.
    """
    need = num_params * BYTES_PER_PARAM[settings.mixed_precision] / settings.ranks_per_cell / 1e9
    have = settings.memory_per_rank_gb
    if have is not None and need > have:
        raise ShardingError(
            f"model of {num_params / 1e9:.3g} B parameters needs {need:.3g} GB per rank of "
            f"training state over ShardingSettings.ranks_per_cell={settings.ranks_per_cell} "
            f"ranks ({BYTES_PER_PARAM[settings.mixed_precision]} B/param), "
            f"ShardingSettings.memory_per_rank_gb={have:g}: "
            f"use ≥ {-(-num_params * BYTES_PER_PARAM[settings.mixed_precision] // int(have * 1e9))}"
            f" ranks or a smaller model")
    return need


def model_num_params(model_dir: str) -> int:
    """Parameters of the HF model in ``model_dir``, counted on the meta device (no weights
    are loaded, nothing is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
