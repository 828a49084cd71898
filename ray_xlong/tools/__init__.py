"""Benchmark and demo tooling on top of the product: the mode benchmark on real cells
(``mode_bench``), the fault injector and its audit (``faults``), the job driver used by both
(``driver``), the example training loop with its progress table (``train``), and a
single-process RL loop without Ray for tests, examples and quick experiments (``local_rl``).

May import everything below it (``rllib``, ``cells`` and the lower layers); nothing in the
product imports this package except the CLI (``tests/test_layers.py``).
"""
