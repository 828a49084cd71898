"""The torch-only stages of ``gpu_check.py`` (``--torch-only``): what needs only torch and
transformers, for GPU machines without Ray or vLLM. Imports neither (a test runs it with those
imports blocked); ``ray_xlong.cells.sharded.LearnerRank`` is used as-is, in this process.

| stage            | cuda                                           | cpu (CI smoke)             |
|------------------|------------------------------------------------|----------------------------|
| tree_attention   | model logprobs + grads: tree (xlong_tree,      | xlong_tree, fp32           |
|                  | flex_attention) vs per-trajectory vs dense     |                            |
|                  | mask; fp32 (TF32 off) and bf16                 |                            |
| tree_scaling     | one tree of 4k / 16k / 64k tokens: fwd+bwd     | 256 / 1024 tokens          |
|                  | time and peak memory, tree vs dense vs per-traj|                            |
| learner_rank     | 1-rank FSDP2 LearnerRank step, 0.5B-shaped     | tiny model, gloo           |
|                  | model, bf16; sleep / wake memory, weights kept |                            |
| two_ranks        | 2 NCCL ranks (one GPU: NCCL_HOSTID per rank):  | 2 gloo ranks               |
|                  | FSDP2 step vs plain torch, weight sync read on |                            |
|                  | another stream, a lost peer aborted, survived  |                            |
| versions         | torch, CUDA, NCCL, transformers, GPU ...       | same                       |

Tolerances (fp32: 1e-4 on logprobs, 1e-3 relative on gradients; bf16: 0.1 and 0.1) fail a
stage; every measured difference is in the JSON.
"""

from __future__ import annotations

import os
import pathlib
import socket
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

from ray_xlong.models import TinyModelConfig, build_tiny_model_dir, tiny_causal_lm
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.model import token_logprobs, tree_block_mask, tree_mask_bool
from ray_xlong.trajectory.packing import PackedBatch, micro_batches
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from ray_xlong.trajectory.tree_attention import register, tree_attention_forward, tree_plan

TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (0.1, 0.1)}
"""(max |Δ logprob|, max relative gradient difference) per dtype."""
SIZES = {"cuda": (4096, 16384, 65536), "cpu": (256, 1024)}
"""Tree tokens of ``tree_scaling`` per device."""
HALF_B = TinyModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, intermediate_size=4864, max_position_embeddings=32768)
"""Qwen2.5-0.5B's shape (untied head: ~0.63 B parameters), random weights."""
TINY = TinyModelConfig()


def runs(seed: int, vocab: int, groups: int = 1):
    cfg = SyntheticConfig(num_calls=8, vocab_size=vocab, context_budget=160, failed_prob=0.0,
                          timeout_prob=0.0)
    return synthetic_runs(seed, groups=groups, runs_per_group=3, config=cfg)


def _batch(pack: str, seed: int, device: str) -> PackedBatch:
    packed = TrajectoryProcessor(ProcessorConfig(pack=pack)).process(runs(seed, 200)).packed
    t = packed.to_tensors()
    return PackedBatch.from_tensors({k: v if k in ("run_ids", "layout") else v.to(device)
                                     for k, v in t.items()})


def _logprobs_and_grads(impl: str, pack: str, dtype: torch.dtype, seed: int, device: str):
    model = tiny_causal_lm(TINY, seed=seed, dtype=dtype, attn_implementation=impl).to(device)
    lp = token_logprobs(model, _batch(pack, seed, device))
    lp.float().sum().backward()
    return lp.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in
                                       model.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def stage_tree_attention(device: str, seed: int) -> dict:
    """Tree layout (each tree implementation) vs per-trajectory rows vs a dense tree mask."""
    register()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = {"fp32": torch.float32, "bf16": torch.bfloat16} if device == "cuda" else \
        {"fp32": torch.float32}
    impls = ("xlong_tree", "flex_attention") if device == "cuda" else ("xlong_tree",)
    out: dict[str, Any] = {}
    for name, dtype in cases.items():
        ref_lp, ref_g = _logprobs_and_grads("sdpa", "per_trajectory", dtype, seed, device)
        for impl in (*impls, "sdpa"):                   # sdpa on the tree: the dense mask
            lp, g = _logprobs_and_grads(impl, "tree", dtype, seed, device)
            label = f"{name}_{'dense' if impl == 'sdpa' else impl}"
            out[f"{label}_dlogp"] = float((lp - ref_lp).abs().max())
            out[f"{label}_dgrad"] = _rel(g, ref_g)
    bad = {k: v for k, v in out.items()
           if v > TOLERANCE[k.split("_")[0]][0 if k.endswith("dlogp") else 1]}
    if bad:
        raise AssertionError(f"tree attention differs from per-trajectory beyond tolerance: {bad}")
    return out


def tree_layout(n: int, *, branches: int = 4) -> tuple[torch.Tensor, int, list[tuple[int, int]]]:
    """One tree of ``n`` tokens: a trunk of n/2, then ``branches`` equal branches. Returns
    ``kv_end`` (the rule ``mask[i, j] = j <= i < kv_end[j]``), the trunk length and each
    branch's ``[lo, hi)``."""
    trunk = n // 2
    width = (n - trunk) // branches
    spans = [(trunk + b * width, n if b == branches - 1 else trunk + (b + 1) * width)
             for b in range(branches)]
    kv = torch.full((n,), n, dtype=torch.int64)
    for lo, hi in spans:
        kv[lo:hi] = hi
    return kv, trunk, spans


def _per_trajectory(q, k, v, trunk: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Each root-to-leaf path (trunk ++ branch) as its own causal sequence; outputs placed
    back in the tree's layout (the trunk's from the first path)."""
    out = torch.empty_like(q)
    head = torch.arange(trunk, device=q.device)
    for i, (lo, hi) in enumerate(spans):
        idx = torch.cat([head, torch.arange(lo, hi, device=q.device)])
        o = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                                           is_causal=True, enable_gqa=True)
        out[:, :, lo:hi] = o[:, :, trunk:]
        if i == 0:
            out[:, :, :trunk] = o[:, :, :trunk]
    return out


def _attention_fns(device: str, n: int) -> dict:
    """``name -> f(q, k, v) -> out [1, H, N, D]`` for each way to attend over a tree of ``n``
    tokens (:func:`tree_layout`)."""
    kv, trunk, spans = tree_layout(n)
    kv_end = kv.to(device)
    plan = tree_plan(kv_end[None], torch.ones(1, n, dtype=torch.bool, device=device))
    mask = tree_mask_bool(kv_end[None])
    dummy = torch.nn.Module().eval()
    fns = {"xlong_tree": lambda q, k, v: tree_attention_forward(
        dummy, q, k, v, None, tree_plan=plan)[0].transpose(1, 2),
        "dense": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True),
        "per_trajectory": lambda q, k, v: _per_trajectory(q, k, v, trunk, spans)}
    if device == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        block = tree_block_mask(kv_end[None])
        fns["flex_attention"] = lambda q, k, v: flex(q, k, v, block_mask=block, enable_gqa=True)
    return fns


def _measure(fn, q, k, v, device: str) -> tuple[float, int | None, torch.Tensor]:
    """Seconds and peak device bytes of forward + backward (after a warm-up), and the output."""
    g = torch.randn_like(q)
    for _ in range(2):                                  # warm-up (compile), then measured
        for t in (q, k, v):
            t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn(q, k, v)
        (out.float() * g).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    return seconds, peak, out.detach()


def stage_tree_scaling(device: str, seed: int) -> dict:
    """Attention over one tree of each size: time, memory, and the max difference to the
    per-trajectory output (bf16 on CUDA, fp32 on CPU; Qwen2.5-0.5B's 14 / 2 heads)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Any] = {}
    for n in SIZES[device]:
        shape = [(1, 14, n, 64), (1, 2, n, 64), (1, 2, n, 64)]
        q, k, v = (torch.randn(s, generator=gen, device=device, dtype=dtype).requires_grad_()
                   for s in shape)
        ref = None
        for name, fn in _attention_fns(device, n).items():
            try:
                seconds, peak, o = _measure(fn, q, k, v, device)
            except torch.OutOfMemoryError as exc:
                out[f"{n}_{name}_error"] = f"OOM: {str(exc)[:80]}"
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            ref = o if name == "per_trajectory" or ref is None else ref
            out[f"{n}_{name}_s"] = seconds
            if peak is not None:
                out[f"{n}_{name}_peak_gb"] = peak / 1e9
            out[f"{n}_{name}_out"] = o
        for name in list(out):
            if name.startswith(f"{n}_") and name.endswith("_out"):
                o = out.pop(name)
                out[name.replace("_out", "_maxdiff")] = float((o.float() - ref.float()).abs().max())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: str, name: str, seed: int, *, config: TinyModelConfig) -> str:
    """A model directory of shape ``config`` under ``root`` (built once per name)."""
    path = pathlib.Path(root) / f"model_{name}"
    if not (path / "config.json").exists():
        build_tiny_model_dir(path, seed=seed, config=config)
    return str(path)


def micro(seed: int) -> dict[str, torch.Tensor]:
    """One tree micro-batch of synthetic runs (tensor form, as a rank receives it)."""
    packed = TrajectoryProcessor(ProcessorConfig(row_tokens=256)).process(
        runs(seed, 200, groups=2)).packed
    return micro_batches(packed, max_tokens=100_000)[0].to_tensors()


def learner_rank(device: str, path: str, *, rank: int = 0, world: int = 1, port: int,
                 mixed_precision: str | None) -> Any:
    """A set-up ``LearnerRank`` (its process group joined at ``port``)."""
    from ray_xlong.cells.learner_settings import LearnerSettings  # Ray-free
    from ray_xlong.cells.sharded import LearnerRank
    from ray_xlong.cells.sharding import ShardingSettings

    sharding = ShardingSettings(ranks_per_cell=world, device=device,
                                mixed_precision=mixed_precision)
    lr = LearnerRank(settings=LearnerSettings(model_dir=path, lr=1e-3), sharding=sharding,
                     rank=rank, world_size=world)
    lr.setup("127.0.0.1", port)
    return lr


def stage_learner_rank(device: str, seed: int, root: str) -> dict:
    """A 1-rank FSDP2 step, then sleep / wake: device memory at each point, and the weights
    after wake-up equal those before sleep (bit for bit)."""
    import torch.distributed as dist

    cuda = device == "cuda"
    path = model_dir(root, "half_b" if cuda else "tiny", seed, config=HALF_B if cuda else TINY)
    t0 = time.perf_counter()
    rank = learner_rank(device, path, port=_free_port(), mixed_precision="bf16" if cuda else None)
    try:
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        targets = rank.accumulate(micro(seed))
        grads = rank.take_gradients()
        rank.apply_step([grads], float(targets), 1)
        if device == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        before = rank.get_weights()
        t0 = time.perf_counter()
        rank.sleep()
        sleep_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rank.wake_up()
        wake_s = time.perf_counter() - t0
        after = rank.get_weights()
        kept = all(torch.equal(before[k], after[k]) for k in before)
        if not kept:
            raise AssertionError("LearnerRank weights changed across sleep / wake")
        params = sum(t.numel() for t in before.values())
        out = {"params_m": params / 1e6, "setup_s": setup_s, "step_s": step_s,
               "sleep_s": sleep_s, "wake_s": wake_s, "weights_kept": kept, "targets": targets}
        out.update({f"{k}_gb": v / 1e9 for k, v in rank.sleep_memory.items()})
        return out
    finally:
        dist.destroy_process_group()


def stage_versions(device: str) -> dict:
    """Versions of what the torch-only check used (no Ray, no vLLM)."""
    import platform

    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    for name in ("accelerate", "triton", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if device == "cuda":
        out.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   gpu_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
    return out


def run(device: str, seed: int, *, root: str | None = None) -> dict:
    """Every torch-only stage (each runs even when an earlier one failed)."""
    import traceback

    from gpu_check_ranks import stage_two_ranks

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check --device cuda --torch-only: torch sees no CUDA device")
    root = root or tempfile.mkdtemp(prefix="gpu_check_torch_")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    torch.manual_seed(seed)
    stages = {"tree_attention": lambda: stage_tree_attention(device, seed),
              "tree_scaling": lambda: stage_tree_scaling(device, seed),
              "learner_rank": lambda: stage_learner_rank(device, seed, root),
              "two_ranks": lambda: stage_two_ranks(device, seed, root),
              "versions": lambda: stage_versions(device)}
    results = {}
    for name, stage in stages.items():
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, **stage()}
        except Exception as exc:  # noqa: BLE001 - a stage's failure is a table row
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        results[name]["seconds"] = time.perf_counter() - t0
    return {"device": device, "seed": seed, "torch_only": True, "torch": torch.__version__,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "stages": results}
