"""The run viewer: ``ray-xlong inspect RUNS.jsonl --html OUT.html [--tokenizer DIR]``.

:func:`write_page` renders a recording's runs, their trajectories and prefix trees into one
self-contained HTML page (``page.py``); with a tokenizer directory the tokens show as text.
May import ``trajectory`` and ``models`` only (no ray, no vllm): the page is made offline.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

from ray_xlong.trajectory import AgentRun, TrajectoryBatch
from ray_xlong.viewer.page import render_page


def write_page(path: str | pathlib.Path, runs: Sequence[AgentRun], batch: TrajectoryBatch, *,
               title: str, tokenizer: str | None = None) -> pathlib.Path:
    """Write the viewer page of ``runs`` / ``batch`` to ``path`` (folders created).

    Args:
        path: the ``.html`` file.
        runs: the recording's runs.
        batch: their processed batch (``TrajectoryProcessor.process``).
        title: the page title.
        tokenizer: a HF tokenizer directory (``ray_xlong.models.load_tokenizer``) to decode
            token ids; None shows ids.

    Returns:
        The path written.
    """
    decode = None
    if tokenizer is not None:
        from ray_xlong.models import load_tokenizer

        tok = load_tokenizer(tokenizer)
        decode = lambda ids: tok.decode([int(i) for i in ids])  # noqa: E731
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(runs, batch, title=title, decode=decode), encoding="utf-8")
    return out


__all__ = ["render_page", "write_page"]
