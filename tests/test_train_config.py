"""Config files: YAML → TrainSpec → XLongConfig. Every field is checked against its dataclass
and an error names the field and the file line (or the --set) it came from; the printed config
loads back to the same spec; the example configs load."""

from __future__ import annotations

import pathlib
import re

import pytest

from ray_xlong.train_config import (ConfigError, TrainSpec, default_spec, dump, load_spec)

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_a_file_sets_fields_of_every_section(tmp_path):
    path = write(tmp_path, "run:\n  steps: 3\n  trackers: [mlflow]\ntraining:\n  lr: 1e-4\n"
                 "xlong:\n  mode: async\n  loss: {kind: tis, tis_cap: 1.5}\n"
                 "  harness:\n    max_calls: 7\n")
    spec = load_spec(path)
    assert (spec.run.steps, spec.run.trackers, spec.training.lr) == (3, ("mlflow",), 1e-4)
    assert (spec.xlong.mode, spec.xlong.loss.kind, spec.xlong.loss.tis_cap) == ("async", "tis",
                                                                               1.5)
    assert spec.xlong.harness.max_calls == 7
    assert spec.xlong.harness.max_new_tokens == default_spec().xlong.harness.max_new_tokens


def test_layers_file_then_flags_then_set(tmp_path):
    path = write(tmp_path, "run:\n  steps: 3\nxlong:\n  mode: async\n")
    spec = load_spec(path, flags={"run.steps": 4}, sets=["run.steps=5", "xlong.cells=3"])
    assert (spec.run.steps, spec.xlong.mode, spec.xlong.cells) == (5, "async", 3)


@pytest.mark.parametrize("text, message", [
    pytest.param("run:\n  steps: 3\nxlong:\n  mode: fast\n",
                 ":4: xlong.mode: XLongOptions.mode must be one of", id="bad-value"),
    pytest.param("xlong:\n  cells: 2\n  runs_per_grup: 4\n",
                 ":3: xlong.runs_per_grup: unknown field (did you mean 'runs_per_group'?)",
                 id="unknown-field"),
    pytest.param("\nrunn:\n  steps: 3\n", ":2: unknown section 'runn' (did you mean 'run'?)",
                 id="unknown-section"),
    pytest.param("run:\n  steps: three\n", ":2: run.steps must be int, got 'three'",
                 id="wrong-type"),
    pytest.param("run:\n  steps: 0\n", ":2: run.steps: RunOptions.steps must be an int >= 1",
                 id="steps-0"),
    pytest.param("training:\n  lr: -1\n", ":2: training.lr: TrainingOptions.lr must be > 0",
                 id="negative-lr"),
    pytest.param("xlong:\n  loss:\n    kind: ppo\n",
                 ":3: xlong.loss.kind: LossConfig.kind must be", id="nested-bad-value"),
    pytest.param("xlong:\n  harness:\n    max_calls: 4\n    temperature: -2\n",
                 ":4: xlong.harness.temperature: HarnessConfig.temperature", id="nested-line"),
    pytest.param("xlong:\n  loss: ppo\n", ":2: xlong.loss must be a mapping", id="not-a-mapping"),
    pytest.param("run:\n  trackers: [comet]\n", ":2: run.trackers: RunOptions.trackers",
                 id="unknown-tracker"),
    pytest.param("xlong:\n  runs_per_group: 3\n", "must be a multiple of xlong.runs_per_group",
                 id="batch-not-multiple"),
    pytest.param("- a list\n", ":1: the file must be a mapping of sections",
                 id="not-a-mapping-file"),
    pytest.param("run: [\n", "not valid YAML", id="bad-yaml"),
])
def test_errors_name_the_field_and_the_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert message in str(err.value)
    assert path in str(err.value)


def test_set_errors_name_the_set():
    with pytest.raises(ConfigError, match=r"--set xlong.staleness_bound=-1: "
                       r"xlong.staleness_bound: XLongOptions.staleness_bound"):
        load_spec(sets=["xlong.staleness_bound=-1"])


def test_every_field_of_every_section_is_type_checked():
    # a list is wrong for every scalar field; a number is wrong for the one list field
    checked = 0
    for section, options in default_spec().as_dict().items():
        for name, value in options.items():
            fields = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in fields:
                key = f"{section}.{name}" + (f".{sub}" if sub else "")
                bad = "12" if isinstance(v, list) else "[1]"
                with pytest.raises(ConfigError, match=re.escape(f"--set {key}={bad}: {key}")):
                    load_spec(sets=[f"{key}={bad}"])
                checked += 1
    assert checked > 40


def test_printed_config_loads_back_to_the_same_spec(tmp_path):
    spec = load_spec(sets=["xlong.loss.kind=tis", "run.trackers=[wandb, mlflow]",
                           "training.grad_clip=null"])
    again = load_spec(write(tmp_path, dump(spec)), base=TrainSpec())
    assert again == spec


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_configs_load_and_build_an_algorithm_config(path):
    pytest.importorskip("ray.rllib")
    spec = load_spec(str(path))
    config = spec.algorithm_config(model_dir="/tmp/policy")
    assert config.xlong_options == dataclasses_replace(spec.xlong, model_dir="/tmp/policy")
    assert config.groups_per_step * spec.xlong.runs_per_group \
        == spec.training.train_batch_size_per_learner
    assert config.seed == spec.run.seed and config.lr == spec.training.lr


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_there_are_example_configs():
    assert len(EXAMPLES) >= 3
