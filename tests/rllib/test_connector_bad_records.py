"""Malformed records reaching ``PrefixTreeConnector`` (issue 7, item 5).

Records are validated when built, but a run reaches the Learner unpickled from an EnvRunner
(``__post_init__`` does not run then) or with a field overwritten; each corruption below is
made that way. The connector must raise :class:`RecordError` naming the run, the call and the
field — or, configured with ``on_malformed_run="skip"``, leave the run out and count it in
``xlong/runs_malformed``. Never a silent drop, never a crash deep inside the learner.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from ray_xlong.rllib.connector import PrefixTreeConnector, packed_from_batch
from ray_xlong.rllib.episodes import RUN_KEY, run_to_episode
from ray_xlong.trajectory import (AgentRun, ModelCall, ProcessorConfig, RecordError,
                                  TrajectoryProcessor, check_run)
from tests.rllib.test_connector import assert_same_packed

pytestmark = [pytest.mark.rllib, pytest.mark.timeout(60)]

# Token ids that read as the conversation: context words >= 100, generated words < 100.
SYS, TASK, TOOL = 100, 101, 102
PLAN, EDIT, DONE = 1, 2, 4
VOCAB = 128


def good_run(run_id, *, group="g", reward=1.0):
    """main: SYS TASK >PLAN EDIT TOOL >DONE (two calls, one trajectory)."""
    return AgentRun(run_id, group, [
        ModelCall("c0", "main", "main", [SYS, TASK], [PLAN, EDIT], [-0.5, -0.5], 0),
        ModelCall("c1", "main", "main", [SYS, TASK, PLAN, EDIT, TOOL], [DONE], [-0.1], 0),
    ], reward, "finished")


def smuggle(run, fix):
    """``run`` after ``fix(run)`` corrupts it, carried through pickle like an EnvRunner's run
    (no constructor check runs on the way)."""
    fix(run)
    return pickle.loads(pickle.dumps(run))


def set_field(target, name, value):
    object.__setattr__(target, name, value)


# (id, corruption of r1, words the error must contain)
CORRUPTIONS = [
    pytest.param(lambda r: set_field(r.calls[1], "output_ids", np.array([4.0])),
                 ("'c1'", "output_ids", "integers"), id="float-output-ids"),
    pytest.param(lambda r: set_field(r.calls[0], "input_ids", np.array([SYS, TASK], np.int32)
                                     .astype(np.float32)),
                 ("'c0'", "input_ids", "integers"), id="float-input-ids"),
    pytest.param(lambda r: set_field(r.calls[0], "output_logprobs", np.array([-0.5])),
                 ("'c0'", "output_logprobs has 1 values for 2"), id="logprob-length"),
    pytest.param(lambda r: set_field(r.calls[0], "output_logprobs", np.array([-0.5, np.nan])),
                 ("'c0'", "NaN"), id="nan-logprob"),
    pytest.param(lambda r: set_field(r.calls[1], "input_ids",
                                     np.array([SYS, TASK, PLAN, EDIT, -7])),
                 ("'c1'", "input_ids", "negative id (-7)"), id="negative-input-id"),
    pytest.param(lambda r: set_field(r.calls[0], "output_ids", np.array([PLAN, -1])),
                 ("'c0'", "output_ids", "negative"), id="negative-output-id"),
    pytest.param(lambda r: set_field(r.calls[1], "output_ids",
                                     np.array([2**63 + 5], np.uint64)),
                 ("'c1'", "output_ids", "beyond int64"), id="uint64-overflow"),
    pytest.param(lambda r: object.__delattr__(r.calls[0], "output_logprobs"),
                 ("calls[0]", "missing", "output_logprobs"), id="missing-field"),
    pytest.param(lambda r: set_field(r.calls[1], "policy_version", -1),
                 ("'c1'", "policy_version"), id="negative-version"),
    pytest.param(lambda r: set_field(r, "reward", float("nan")),
                 ("'r1'", "reward must be finite"), id="nan-reward"),
    pytest.param(lambda r: set_field(r, "status", "crashed"),
                 ("'r1'", "status 'crashed'"), id="unknown-status"),
    pytest.param(lambda r: set_field(r, "calls", (r.calls[0], {"call_id": "c1"})),
                 ("'r1'", "calls[1] is a dict"), id="dict-not-a-call"),
    pytest.param(lambda r: set_field(r.calls[1], "kind", "critic"),
                 ("'c1'", "kind 'critic'"), id="unknown-kind"),
]


def connect(runs, *, config=ProcessorConfig(), metrics=None):
    piece = PrefixTreeConnector(config=config)
    return piece(rl_module=None, batch={}, episodes=[run_to_episode(r) for r in runs],
                 metrics=metrics)


def batch_with(corrupt):
    """r0 and r2 good; r1 corrupted after it arrived (episodes pickled as from an EnvRunner)."""
    runs = [good_run("r0"), good_run("r1", reward=0.0), good_run("r2", reward=0.5)]
    episodes = pickle.loads(pickle.dumps([run_to_episode(r) for r in runs]))
    corrupt(episodes[1].custom_data[RUN_KEY])
    return episodes


@pytest.mark.parametrize("corrupt,words", CORRUPTIONS)
def test_malformed_run_raises_naming_run_call_and_field(corrupt, words):
    episodes = batch_with(corrupt)
    with pytest.raises(RecordError) as info:
        PrefixTreeConnector()(rl_module=None, batch={}, episodes=episodes)
    message = str(info.value)
    assert "'r1'" in message or "calls[" in message, message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("corrupt,words", CORRUPTIONS)
def test_skip_mode_leaves_the_run_out_and_counts_it(corrupt, words):
    config = ProcessorConfig(on_malformed_run="skip")
    metrics = MetricsLogger()
    batch = PrefixTreeConnector(config=config)(rl_module=None, batch={},
                                               episodes=batch_with(corrupt), metrics=metrics)
    logged = metrics.peek((DEFAULT_MODULE_ID,))
    assert logged["xlong/runs_malformed"] == 1 and logged["xlong/runs"] == 2
    # The same batch as the good runs alone: r1 is out of its group's baseline too.
    want = TrajectoryProcessor(config).process([good_run("r0"), good_run("r2", reward=0.5)])
    assert_same_packed(packed_from_batch(batch[DEFAULT_MODULE_ID]), want.packed)


def test_skip_mode_reports_the_error_per_run():
    run = good_run("r1")
    set_field(run.calls[0], "output_logprobs", np.array([-0.5, np.inf]))
    result = TrajectoryProcessor(ProcessorConfig(on_malformed_run="skip")).process(
        [good_run("r0"), run])
    assert list(result.malformed) == ["r1"] and "NaN or infinite" in result.malformed["r1"]
    assert result.stats.runs_malformed == 1 and result.stats.runs == 1
    assert result.failed_run_ids == ()


def test_ids_outside_the_vocabulary_name_the_call():
    run = good_run("r1")
    set_field(run.calls[1], "input_ids", np.array([SYS, TASK, PLAN, EDIT, VOCAB + 3]))
    with pytest.raises(RecordError, match=r"'c1'.*input_ids holds id 131, outside the "
                                          r"vocabulary \[0, 128\)"):
        connect([good_run("r0"), run], config=ProcessorConfig(vocab_size=VOCAB))
    connect([good_run("r0"), good_run("r2")], config=ProcessorConfig(vocab_size=VOCAB))


def test_a_run_corrupted_before_pickling_is_caught_after_it():
    """Unpickling runs no constructor check: the connector's check is the one that counts."""
    run = smuggle(good_run("r1"), lambda r: set_field(r.calls[0], "output_logprobs",
                                                       np.array([-0.5, np.nan])))
    with pytest.raises(RecordError, match=r"run 'r1'.*'c0'.*NaN"):
        connect([good_run("r0"), run])


def test_check_run_accepts_what_construction_accepts():
    run = smuggle(good_run("r0"), lambda r: None)
    check_run(run, vocab_size=VOCAB)
    with pytest.raises(RecordError, match="expected an AgentRun, got dict"):
        check_run({"run_id": "r0"})


def test_a_valid_batch_is_unchanged_by_the_checks():
    runs = [good_run("r0"), good_run("r1", reward=0.0)]
    got = connect(runs)[DEFAULT_MODULE_ID]
    want = TrajectoryProcessor(ProcessorConfig()).process(runs).packed
    assert_same_packed(packed_from_batch(got), want)
