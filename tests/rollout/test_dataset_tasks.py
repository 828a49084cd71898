"""Dataset tasks (``rollout/tasks/dataset.py``): JSONL, parquet and HF ``datasets`` rows become
instances; the stream is a per-epoch permutation drawn from the seed; a split is disjoint; bad
rows are errors naming the file and the row; the cells' job hands the group index through."""

from __future__ import annotations

import asyncio
import json

import pytest

from ray_xlong.rollout.tasks import DatasetRowError, DatasetTask, PromptEnv, exact_match

ROWS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (5, 0), (2, 2), (7, 1), (6, 3)]]
ENV = PromptEnv.factory(reward=exact_match)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "adds.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    return path


def test_jsonl_rows_become_instances_scored_by_the_reward(jsonl):
    task = DatasetTask.from_jsonl(jsonl, env=ENV, required=("prompt", "answer"))
    assert (task.name, len(task)) == ("adds", 6)
    env = task(0)
    row = task.row(0)
    assert env.reset().prompt == row["prompt"]
    env.submit(row["answer"] + " ")
    assert env.score() == 1.0
    env.submit("nope")
    assert env.score() == 0.0
    with pytest.raises(Exception, match="no tools"):
        asyncio.run(env.call_tool("add", {}))


def test_parquet_reads_the_same_rows(tmp_path, jsonl):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "adds.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    a = DatasetTask.from_parquet(path, env=ENV, seed=3)
    b = DatasetTask.from_jsonl(jsonl, env=ENV, seed=3)
    assert [a.row(i) for i in range(12)] == [b.row(i) for i in range(12)]


def test_hf_datasets_split_reads_the_same_rows(tmp_path, jsonl, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    from_obj = DatasetTask.from_hf(datasets.Dataset.from_list(ROWS), env=ENV, name="adds")
    from_file = DatasetTask.from_hf(str(jsonl), env=ENV, name="adds")
    assert from_obj.rows == from_file.rows == ROWS
    assert from_file.source.endswith("adds.jsonl[train]")


def test_epochs_are_permutations_drawn_from_the_seed(jsonl):
    task = DatasetTask.from_jsonl(jsonl, env=ENV, seed=0)
    epochs = [[task.position(e * 6 + k).row for k in range(6)] for e in range(3)]
    assert all(sorted(e) == list(range(6)) for e in epochs)      # each row once per epoch
    assert len({tuple(e) for e in epochs}) == 3                   # a fresh order each epoch
    again = DatasetTask.from_jsonl(jsonl, env=ENV, seed=0)
    assert [again.position(i).row for i in range(18)] == sum(epochs, [])
    other = DatasetTask.from_jsonl(jsonl, env=ENV, seed=1)
    assert [other.position(i).row for i in range(18)] != sum(epochs, [])
    p = task.position(13)
    assert (p.epoch, p.offset, p.row) == (2, 1, epochs[2][1])


def test_split_is_disjoint_deterministic_and_keeps_row_numbers(jsonl):
    task = DatasetTask.from_jsonl(jsonl, env=ENV, seed=0)
    train, held = task.split(eval_fraction=1 / 3)
    assert (len(train), len(held), held.name) == (4, 2, "adds_eval")
    assert sorted(train.row_ids + held.row_ids) == list(range(6))
    assert [r["prompt"] for r in held.rows] == [ROWS[i]["prompt"] for i in held.row_ids]
    again = DatasetTask.from_jsonl(jsonl, env=ENV, seed=0).split(eval_rows=2)
    assert again[1].row_ids == held.row_ids
    with pytest.raises(ValueError, match="exactly one"):
        task.split()


@pytest.mark.parametrize("text,match", [
    pytest.param('{"prompt": "a"}\n{"prompt": \n', r"adds.jsonl: row 1 \(line 2\): invalid JSON",
                 id="bad-json"),
    pytest.param('{"prompt": "a"}\n\n[1, 2]\n', r"adds.jsonl: row 1: must be an object",
                 id="not-an-object"),
    pytest.param('{"prompt": "a"}\n{"question": "b"}\n', r"adds.jsonl: row 1: missing key",
                 id="missing-key"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, text, match):
    path = tmp_path / "adds.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetRowError, match=match):
        DatasetTask.from_jsonl(path, env=ENV, required=("prompt",))


def test_a_row_the_environment_rejects_is_named(tmp_path):
    path = tmp_path / "adds.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": 7}\n')
    task = DatasetTask.from_jsonl(path, env=ENV)
    bad = next(i for i in range(2) if task.position(i).row == 1)
    with pytest.raises(DatasetRowError, match=r"adds.jsonl: row 1: the environment failed"):
        task(bad)


def test_the_job_gives_a_dataset_the_global_group_index(jsonl):
    from ray_xlong.cells.task_job import TaskJob

    task = DatasetTask.from_jsonl(jsonl, env=ENV)
    job = TaskJob(task.name, seed=5, group_offset=10, factory=task)
    assert [job.spec(r, runs_per_group=4).seed for r in (0, 3, 4, 9)] == [10, 10, 11, 12]
    assert job.tasks() == {"adds": task}
