"""Tooling of the benchmarks and tests, not of the product: the fault injector and its audit
(``faults``), a single-process RL loop without Ray (``local_rl``) and the shared entry of the
benchmark scripts (``entry``: argparse, the table, ``--json``). Imports the product freely;
the product never imports it."""
