"""Experiment trackers: an unknown one is an error naming it. The trackers read back from what
they wrote (W&B offline, MLflow in a file store, TensorBoard), driven the way ``ray-xlong train``
does (``TrackerSession``) and under ``tune.Tuner`` with a real ``XLongAlgorithm`` (the
documented Python way), are ``test_algorithm_tune.py``'s: they share its module Ray."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from ray_xlong.rllib.trackers import tracker_callbacks  # noqa: E402


def test_unknown_tracker_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="unknown \\['comet'\\]"):
        tracker_callbacks(("wandb", "comet"), project="p", out_dir=tmp_path)
