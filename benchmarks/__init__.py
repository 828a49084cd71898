"""Benchmark scripts (``python benchmarks/<name>.py``): each takes a seed, prints a markdown table
with ratios measured side by side in one run and writes ``--json PATH``; ``tools/`` holds the
tooling they share (the fault injector, the single-process RL loop, the entry helper)."""
