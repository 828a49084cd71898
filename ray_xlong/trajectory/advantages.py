"""GRPO-style advantages per group: ``A = reward − mean(group)``, optionally ``÷ (std + eps)``.

* ``timeout`` runs count like ``finished`` ones, with their (partial) reward.
* ``failed`` runs (environment errors, not the policy's doing) are excluded from training *and*
  from the group baseline: counting an infrastructure failure as a low reward would punish the
  policy's other attempts at that task for nothing. A group whose runs all failed trains nothing.
* A group with a single trainable run has advantage 0 (no baseline to compare against).

The advantage of a run is broadcast to all of its trainable tokens by the packer.
"""

from __future__ import annotations

import math
from typing import Sequence

from ray_xlong.trajectory.records import AgentRun


def group_advantages(runs: Sequence[AgentRun], *, normalize_std: bool = False,
                     eps: float = 1e-6) -> dict[str, float]:
    """Advantage of every non-failed run, keyed by run id.

    Args:
        runs: runs of any number of groups (grouped by ``group_id``).
        normalize_std: divide by the group's population std (+ ``eps``).
        eps: added to the std.

    Returns:
        ``{run_id: advantage}`` for every run whose status is not ``failed``.
    """
    groups: dict[str, list[AgentRun]] = {}
    for run in runs:
        if run.status != "failed":
            groups.setdefault(run.group_id, []).append(run)
    out: dict[str, float] = {}
    for members in groups.values():
        rewards = [r.reward for r in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        for run in members:
            adv = run.reward - mean
            out[run.run_id] = adv / (std + eps) if normalize_std else adv
    return out
