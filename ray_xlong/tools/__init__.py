"""Benchmark and demo tooling on top of the product: the mode benchmark on real cells
(``mode_bench``), the fault injector and its audit (``faults``), the job driver used by both
(``driver``), and the example training loop with its progress table (``train``).

May import everything below it (``rllib``, ``cells`` and the lower layers); nothing in the
product imports this package except the CLI (``tests/test_layers.py``).
"""
