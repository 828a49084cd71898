"""An agent's context: one preallocated token buffer that calls see as views (no copies).

    buf  [bos sys .. user .. asst | out0 .. | tool .. asst | out1 ..]  ...........  (capacity)
          └─ call 0 input ──────┘ └ out0 ┘
          └─ call 1 input ─────────────────────────────────┘ └ out1 ┘

A call's ``input_ids`` is ``buf[:n]`` and, when the output is accepted, its ``output_ids`` is
``buf[n:n+m]``: adjacent views of one buffer, which the trajectory processor joins by pointer.
The buffer is never reallocated (recorded calls hold views of it), so it has a fixed capacity;
:class:`ContextFull` is raised instead of growing. Positions below ``n`` are never rewritten.
"""

from __future__ import annotations

import numpy as np

from ray_xlong.trajectory.records import append_only


class ContextFull(RuntimeError):
    """Appending would pass the context's capacity."""


class Context:
    """A growing token context in a fixed buffer."""

    def __init__(self, prefix: np.ndarray, *, capacity: int) -> None:
        if prefix.size > capacity:
            raise ContextFull(f"prompt of {prefix.size} tokens exceeds capacity {capacity}")
        self.buf = np.zeros(capacity, dtype=np.int64)
        append_only(self.buf)      # calls' range checks scan only what was appended since
        self.n = 0
        self.append(prefix)

    @property
    def capacity(self) -> int:
        """Buffer size in tokens."""
        return int(self.buf.size)

    def room(self) -> int:
        """Tokens that still fit."""
        return self.capacity - self.n

    def append(self, tokens: np.ndarray) -> np.ndarray:
        """Append ``tokens``; returns the view of the buffer that now holds them."""
        if self.n + tokens.size > self.buf.size:
            raise ContextFull(f"context of {self.n} + {tokens.size} tokens exceeds capacity "
                              f"{self.buf.size}")
        start = self.n
        self.buf[start:start + tokens.size] = tokens
        self.n += tokens.size
        return self.buf[start:self.n]

    def view(self) -> np.ndarray:
        """The context so far, ``buf[:n]``."""
        return self.buf[:self.n]
