"""Write ``tests/durations.json`` (seconds per test file, set-up included) from the JUnit XML of
full runs, e.g. ``make test-all`` writes ``.pytest-*.xml``::

    python tests/durations.py .pytest-phase1.xml .pytest-phase2.xml

The root ``conftest.py`` hands out the longest files first under pytest-xdist."""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

OUT = pathlib.Path(__file__).with_name("durations.json")


def file_seconds(paths: list[str]) -> dict[str, float]:
    """Seconds per test file over the test cases of the JUnit XML files ``paths``."""
    total: dict[str, float] = collections.defaultdict(float)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split("::")[0]
            parts = module.split(".")
            # classname is the dotted module (plus a class): keep the parts up to the test file
            for n in range(len(parts), 0, -1):
                candidate = "/".join(parts[:n]) + ".py"
                if pathlib.Path(candidate).exists():
                    total[candidate] += float(case.get("time", 0.0))
                    break
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> None:
    seconds = file_seconds(argv)
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s → {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
