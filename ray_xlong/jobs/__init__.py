"""Whole jobs on cells, as the command line and the examples run them: the training loop with its
progress table behind ``ray-xlong train`` and ``examples/train_elastic.py`` (``train``), a job of
one policy on a pool of cells (``driver``), and the side-by-side comparison of modes on real
cells behind ``ray-xlong bench --backend ray`` (``mode_bench``).

May import everything below it (``rllib``, ``cells`` and the lower layers); nothing in the
product imports this package except the CLI (``tests/test_layers.py``).
"""
