"""The run viewer: recorded runs → one self-contained HTML page (no scripts, fonts or images
from elsewhere; opens from disk in any browser).

```
<header>  the recording: runs, calls, trajectories kept / dropped, tokens Σ → unique, trainable
<nav>     one link per run (status, reward)
<section id="run-<id>">  per run
   stats     status, reward, calls, trajectories, tree tokens / trainable
   calls     in order: agent, kind, parent, version, the input's new tokens (what this call added
             to its agent's context) and the output (model-generated: highlighted)
   trajectories  kept (rank, origin, calls, tokens, weighted) and dropped (struck through)
   tree      the prefix tree as nested lists: a node's tokens, trainable spans highlighted,
             owner trajectory and depth
```

Tokens are shown as text when a ``decode`` callable is given (``ids → str``, e.g. a HF
tokenizer's ``decode``), as ids otherwise; a long span shows its head and tail and says how many
tokens it elides. Classes the test (and a reader's eye) rely on: ``run``, ``call``, ``gen``
(model-generated), ``trainable``, ``kept``, ``dropped``, ``node``.
"""

from __future__ import annotations

import html
from typing import Callable, Sequence

import numpy as np

from ray_xlong.trajectory import AgentRun, TrajectoryBatch
from ray_xlong.trajectory.assembly import common_prefix_len
from ray_xlong.trajectory.tree import TreeNode

Decode = Callable[[np.ndarray], str]
"""``ids → text`` (a tokenizer's ``decode``)."""

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7fb}
header{background:#1d2330;color:#fff;padding:12px 20px}header h1{font-size:20px;margin:0 0 4px}
nav{padding:8px 20px;background:#e7eaf3}nav a{margin-right:12px;text-decoration:none}
section.run{background:#fff;margin:14px 20px;padding:10px 16px;border-radius:8px;
 box-shadow:0 1px 3px #0002}
h2{font-size:17px;margin:4px 0}h3{font-size:15px;margin:10px 0 4px}
table{border-collapse:collapse;margin:4px 0}td,th{border:1px solid #d5d9e4;padding:3px 7px;
 text-align:left;vertical-align:top}th{background:#eef1f7}
.tok{font-family:ui-monospace,monospace;white-space:pre-wrap;word-break:break-all}
.gen{background:#ffe08a}.trainable{background:#9be3a6}.ctx{color:#555}
.elided{color:#999;font-style:italic}tr.dropped{color:#999;text-decoration:line-through}
tr.kept td:first-child{color:#0a7a2f;font-weight:600}
.status-finished{color:#0a7a2f}.status-timeout{color:#a86400}.status-failed{color:#b3261e}
ul.tree,ul.tree ul{list-style:none;margin:0;padding-left:18px;border-left:1px dashed #b8bfd0}
li.node{margin:3px 0}.meta{color:#667;font-size:12px;margin-left:6px}
.legend span{padding:0 6px;margin-right:8px}
"""


def render_page(runs: Sequence[AgentRun], batch: TrajectoryBatch, *, title: str,
                decode: Decode | None = None, max_span_tokens: int = 160) -> str:
    """The HTML page of ``runs`` and their processed ``batch``.

    Args:
        runs: the recording's runs, in order.
        batch: ``TrajectoryProcessor(...).process(runs)`` (``pack="none"`` is enough).
        title: the page title (e.g. the file name).
        decode: ``ids → text``; None shows token ids.
        max_span_tokens: longest token span shown in full (longer: head … tail).

    Returns:
        The page (a complete HTML document).
    """
    show = _Tokens(decode, max_span_tokens)
    s = batch.stats
    head = (f"{len(runs)} runs · {sum(len(r.calls) for r in runs)} calls · "
            f"{s.trajectories_kept} trajectories kept, {s.trajectories_dropped} dropped · "
            f"tokens Σ {s.total_tokens:,} → unique {s.unique_tokens:,} "
            f"(dedup {s.dedup_ratio:.2f}×) · trainable {s.trainable_tokens:,} · "
            f"timeouts {s.runs_timeout}, failed {s.runs_failed}")
    nav = " ".join(f'<a href="#run-{_e(r.run_id)}">{_e(r.run_id)} '
                   f'<span class="status-{r.status}">{r.status}</span> {r.reward:g}</a>'
                   for r in runs)
    body = "\n".join(_run_section(r, batch, show) for r in runs)
    legend = ('<div class="legend">tokens: <span class="gen">model-generated</span>'
              '<span class="trainable">trainable (tree)</span><span class="ctx">context</span>'
              f'{"" if decode else " (token ids: pass a tokenizer for text)"}</div>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<title>{_e(title)}</title><style>{CSS}</style></head><body>\n'
            f'<header><h1>{_e(title)}</h1><div id="summary">{_e(head)}</div>{legend}</header>\n'
            f'<nav>{nav}</nav>\n{body}\n</body></html>\n')


class _Tokens:
    """Token spans → escaped HTML (decoded or ids, long spans elided)."""

    def __init__(self, decode: Decode | None, limit: int) -> None:
        self.decode, self.limit = decode, limit

    def text(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        if ids.size > self.limit:
            half = self.limit // 2
            return (self._plain(ids[:half]) + f'<span class="elided"> … {ids.size - 2 * half} '
                    f'tokens … </span>' + self._plain(ids[-half:]))
        return self._plain(ids)

    def _plain(self, ids: np.ndarray) -> str:
        if self.decode is None:
            return _e(" ".join(str(int(i)) for i in ids) + (" " if ids.size else ""))
        return _e(self.decode(ids))

    def span(self, ids: np.ndarray, cls: str) -> str:
        return f'<span class="tok {cls}">{self.text(ids)}</span>' if np.size(ids) else ""


def _run_section(run: AgentRun, batch: TrajectoryBatch, show: _Tokens) -> str:
    kept = [t for t in batch.trajectories if t.run_id == run.run_id]
    dropped = [t for t in batch.dropped if t.run_id == run.run_id]
    tree = batch.trees.get(run.run_id)
    tree_stats = (f" · tree {tree.num_tokens:,} tokens, {tree.num_trainable:,} trainable"
                  if tree is not None else "")
    parts = [f'<section class="run" id="run-{_e(run.run_id)}">',
             f'<h2>run {_e(run.run_id)} <span class="meta">group {_e(run.group_id)}</span></h2>',
             f'<div class="stats"><span class="status-{run.status}">{run.status}</span> · '
             f'reward {run.reward:g} · {len(run.calls)} calls · {len(kept)} trajectories kept, '
             f'{len(dropped)} dropped · generated {run.num_tokens:,} tokens{tree_stats}</div>']
    if run.status == "failed":
        parts.append("<p>failed: not trained, not in its group's baseline</p>")
    parts += ["<h3>calls</h3>", _calls_table(run, show)]
    if kept or dropped:
        parts += ["<h3>trajectories</h3>", _trajectory_table(kept, dropped)]
    if tree is not None:
        parts += ["<h3>prefix tree</h3>", '<ul class="tree">',
                  *(_node(child, show) for child in tree.root.children.values()), "</ul>"]
    parts.append("</section>")
    return "\n".join(parts)


def _calls_table(run: AgentRun, show: _Tokens) -> str:
    rows = ["<table><tr><th>#</th><th>agent</th><th>kind</th><th>parent</th><th>version</th>"
            "<th>in / out</th><th>new input → output</th></tr>"]
    last: dict[str, np.ndarray] = {}
    for i, c in enumerate(run.calls):
        prev = last.get(c.agent_id)
        shared = common_prefix_len(prev, c.input_ids) if prev is not None else 0
        last[c.agent_id] = np.concatenate([c.input_ids, c.output_ids])
        new = show.span(c.input_ids[shared:], "ctx")
        kept = f'<span class="elided">[{shared} shared] </span>' if shared else ""
        rows.append(f'<tr class="call"><td>{i}</td><td>{_e(c.agent_id)}</td><td>{c.kind}</td>'
                    f'<td>{_e(c.parent_agent_id or "")}</td><td>{c.policy_version}</td>'
                    f'<td>{c.input_ids.size} / {c.output_ids.size}</td>'
                    f'<td>{kept}{new}{show.span(c.output_ids, "gen")}</td></tr>')
    rows.append("</table>")
    return "\n".join(rows)


def _trajectory_table(kept: list, dropped: list) -> str:
    rows = ["<table><tr><th>#</th><th>kind</th><th>agent</th><th>origin</th><th>calls</th>"
            "<th>tokens</th><th>generated</th><th>weighted</th></tr>"]
    for label, cls, trajs in (("t", "kept", kept), ("dropped", "dropped", dropped)):
        for i, t in enumerate(trajs):
            weighted = int(t.loss_weights.sum()) if cls == "kept" and t.loss_weights is not None \
                else 0
            name = f"t{i}" if cls == "kept" else label
            rows.append(f'<tr class="{cls}"><td>{name}</td><td>{t.kind}</td>'
                        f'<td>{_e(t.agent_id)}</td><td>{t.origin}</td>'
                        f'<td>{len(t.call_indices)}</td><td>{t.num_tokens:,}</td>'
                        f'<td>{t.num_generated:,}</td><td>{weighted:,}</td></tr>')
    rows.append("</table>")
    return "\n".join(rows)


def _node(node: TreeNode, show: _Tokens) -> str:
    """One tree node and its children: context and trainable spans in order."""
    cuts = sorted((g.lo, g.hi) for g in node.gen)
    spans, at = [], 0
    for lo, hi in cuts:
        if lo > at:
            spans.append(show.span(node.tokens[at:lo], "ctx"))
        spans.append(show.span(node.tokens[max(lo, at):hi], "trainable"))
        at = max(at, hi)
    if at < node.tokens.size:
        spans.append(show.span(node.tokens[at:], "ctx"))
    meta = (f'<span class="meta">t{node.owner} · depth {node.depth}..'
            f'{node.depth + node.tokens.size - 1} · {node.num_trainable} trainable</span>')
    kids = "".join(_node(c, show) for c in node.children.values())
    return (f'<li class="node">{"".join(spans)}{meta}'
            f'{f"<ul>{kids}</ul>" if kids else ""}</li>')


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
