"""The entry every benchmark script shares: the common flags, the table, ``--json``.

```
parser = bench_parser(__doc__)              --seed N  --json PATH  --smoke (tiny budget, CI)
parser.add_argument(...)                    the script's own flags
args = parser.parse_args(argv)
result = run(...)                           a JSON-able dict of what was measured
return finish(result, show=print_table, json_path=args.json)
```

A script is run as ``python benchmarks/<name>.py``; it puts the repository root on
``sys.path`` before importing this module (``benchmarks`` is then a package).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any, Callable


def bench_parser(doc: str | None, *, smoke: bool = True, seed: bool = True,
                 json_required: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the first line of ``doc`` with ``--seed`` (unless
    ``seed=False``: a script that takes several), ``--json`` (required with ``json_required``)
    and (unless ``smoke=False``) ``--smoke``."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0])
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, required=json_required,
                        help="write the results here")
    if smoke:
        parser.add_argument("--smoke", action="store_true", help="tiny budget (CI)")
    return parser


def finish(result: dict[str, Any], *, show: Callable[[dict[str, Any]], None],
           json_path: str | None) -> dict[str, Any]:
    """Print ``result``'s table (``show``), write it to ``json_path`` (if given); return it."""
    show(result)
    if json_path:
        path = pathlib.Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
    return result
