"""Exact loss on any architecture: ``token_logprobs`` per layout vs the model's own forward.

    python benchmarks/architectures.py --json out/architectures.json [--seed 0] [--archs ...]

For each HF causal-LM architecture a tiny random model is built from its config (never
downloaded; fp32; soft-capping, logit scaling and sliding windows switched on and small, so that
they matter on short sequences). Seeded synthetic runs (compaction, subagent, retries: a real
prefix tree) are processed in both layouts, and ``token_logprobs`` of each is compared with the
reference: every kept trajectory as one plain sequence, ``model(input_ids).logits`` →
``log_softmax``, read at its targets. The table gives the max abs logprob difference per layout
(tree with the dense mask of ``sdpa`` / ``eager``, tree with ``xlong_tree`` or its refusal,
``xlong_tree`` against the dense tree mask, per-trajectory; sliding windows count by depth in
both tree paths), the difference the old path (decoder → output embedding, no post-processing)
would give, and, for ``--grad-archs``, the max abs gradient difference of ``Σ w · logprob``
(tree vs reference, relative to the largest gradient; dense mask and ``xlong_tree``). The pass
bar is ≤ 2e-4 (fp32).
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402
from ray_xlong.models.architectures import ARCHS, build_arch

TOL = 2e-4
GRAD_ARCHS = ("llama", "gemma2-softcap-sliding", "cohere-logit-scale", "mistral-sliding")


def batches(seed: int):
    """Both layouts of one seeded set of synthetic runs."""
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
    from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

    cfg = SyntheticConfig(num_calls=10, vocab_size=64, system_tokens=4, task_tokens=3,
                          tool_tokens_mean=3.0, output_tokens_mean=3.0, context_budget=45,
                          summary_tokens=3, num_subagents=1, subagent_calls=2, num_retries=2,
                          timeout_prob=0.3, failed_prob=0.0)
    runs = synthetic_runs(seed, groups=2, runs_per_group=2, config=cfg)
    out = {}
    for layout in ("tree", "per_trajectory"):
        out[layout] = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=3,
                                                          pack=layout)).process(runs).packed
    return out


def reference(model: torch.nn.Module, flat, *, head_only: bool = False) -> torch.Tensor:
    """Logprobs of ``flat``'s targets with each trajectory run as one plain sequence."""
    out = torch.empty(flat.num_targets)
    for r in range(flat.input_ids.shape[0]):
        n = int(flat.attention_mask[r].sum())
        ids = flat.input_ids[r:r + 1, :n]
        if head_only:                              # the old path: no logit post-processing
            logits = model.get_output_embeddings()(model.get_decoder()(input_ids=ids)
                                                   .last_hidden_state)[0]
        else:
            logits = model(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        sel = (flat.target_row == r).nonzero().flatten()
        out[sel] = logp[flat.target_src[sel], flat.target_ids[sel]]
    return out


def measure(name: str, *, seed: int, grads: bool) -> dict:
    """One table row (see module docstring)."""
    from ray_xlong.trajectory.model import TreeLayoutUnsupported, token_logprobs

    data = batches(seed)
    dense = ARCHS[name][2]
    model = build_arch(name, seed=seed, attn_implementation=dense)
    with torch.no_grad():
        ref = reference(model, data["per_trajectory"])
        row = {"arch": name, "model": type(model).__name__, "attn": dense,
               "targets": int(ref.numel()),
               "tree": float((token_logprobs(model, data["tree"]) - ref).abs().max()),
               "per_trajectory": float((token_logprobs(model, data["per_trajectory"]) - ref)
                                       .abs().max()),
               "old_head_path": float((reference(model, data["per_trajectory"],
                                                 head_only=True) - ref).abs().max())}
    tree_model = build_arch(name, seed=seed, attn_implementation="xlong_tree")
    try:
        with torch.no_grad():
            fast = token_logprobs(tree_model, data["tree"])
            row["xlong_tree"] = float((fast - ref).abs().max())
            row["xlong_vs_dense"] = float((fast - token_logprobs(model, data["tree"]))
                                          .abs().max())
    except TreeLayoutUnsupported as exc:
        row["xlong_tree"] = f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001 - a crash is a table entry, not a silent number
        row["xlong_tree"] = f"error: {type(exc).__name__}: {exc}"
    if grads:
        row["grad_rel"] = grad_diff(model, data)
        if isinstance(row["xlong_tree"], float):
            row["xlong_grad_rel"] = grad_diff(tree_model, data)
    return row


def grad_diff(model: torch.nn.Module, data) -> float:
    """Max abs difference of ∇ Σ w·logprob, tree vs plain sequences, ÷ the largest gradient."""
    from ray_xlong.trajectory.model import token_logprobs

    w = torch.linspace(0.5, 1.5, data["tree"].num_targets)

    def grad(fn):
        model.zero_grad()
        (fn() * w).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    g_tree = grad(lambda: token_logprobs(model, data["tree"]))
    g_ref = grad(lambda: reference(model, data["per_trajectory"]))
    return float((g_tree - g_ref).abs().max() / g_ref.abs().max())


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


def _short(text: str) -> str:
    """``refused: Class: the variant; the way out`` → ``refused (the variant)``."""
    kind, _, rest = text.partition(": ")
    return f"{kind} ({rest.partition(': ')[2].split(';')[0].strip()[:70]})"


def table(rows: list[dict]) -> str:
    lines = ["| architecture | HF class | tree (dense mask) | tree (xlong_tree) | xlong_tree vs "
             "dense | per-trajectory | old head-only path | grad rel diff (dense / xlong_tree) |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        tree = r["xlong_tree"]
        tree = _short(tree) if isinstance(tree, str) else _fmt(tree)
        grad = _fmt(r.get("grad_rel", "-"))
        if "xlong_grad_rel" in r:
            grad += f" / {_fmt(r['xlong_grad_rel'])}"
        lines.append(f"| {r['arch']} | {r['model']} | {_fmt(r['tree'])} ({r['attn']}) | {tree} |"
                     f" {_fmt(r.get('xlong_vs_dense', '-'))} | {_fmt(r['per_trajectory'])} | "
                     f"{_fmt(r['old_head_path'])} | {grad} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, smoke=False, json_required=True)
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--grad-archs", nargs="*", default=list(GRAD_ARCHS), choices=list(ARCHS))
    args = p.parse_args(argv)
    rows = [measure(a, seed=args.seed, grads=a in args.grad_archs) for a in args.archs]
    exact = all(max(r["tree"], r["per_trajectory"]) <= TOL and r.get("grad_rel", 0) <= TOL
                and r.get("xlong_grad_rel", 0) <= TOL
                and (isinstance(r["xlong_tree"], str) or r["xlong_tree"] <= TOL)
                and r.get("xlong_vs_dense", 0) <= TOL for r in rows)
    finish({"seed": args.seed, "tolerance": TOL, "exact": exact, "rows": rows},
           show=show, json_path=args.json)
    return 0 if exact else 1


def show(result: dict) -> None:
    """The table and whether every row is within the tolerance."""
    print(table(result["rows"]))
    print(f"\nall within {result['tolerance']:g} (fp32): {result['exact']}")


if __name__ == "__main__":
    sys.exit(main())
