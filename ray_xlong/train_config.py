"""Config files for ``ray-xlong train``: YAML → :class:`TrainSpec` → ``XLongConfig``.

```yaml
run:                 # RunOptions: what `ray-xlong train` does around the algorithm
  steps: 25
  seed: 1
  trackers: [wandb]  # wandb | mlflow (TensorBoard, CSV and JSON are always written)
training:            # TrainingOptions → XLongConfig.training(...)
  lr: 5.0e-4
  train_batch_size_per_learner: 128    # runs per step (groups × runs_per_group)
xlong:               # XLongOptions → XLongConfig.xlong(...)
  mode: elastic
  loss: {kind: tis, tis_cap: 2.0}      # LossConfig
  harness: {max_calls: 4}              # HarnessConfig
```

Layers, later wins: the recipe's defaults (:func:`default_spec`) ← the file ← the command's
own flags (``--mode``, ``--steps``…) ← ``--set section.field[.sub]=value`` (value read as YAML).
Every field is checked against its dataclass: an unknown key, a wrong type or a value the
dataclass refuses is a :class:`ConfigError` whose message names the field and where it came
from (``FILE:LINE`` or ``--set``). Nothing here starts Ray or builds a model.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Mapping, Sequence

import yaml

from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.checks import is_int
from ray_xlong.rllib.algorithm_config import XLongOptions
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.engine_settings import EngineSettings
from ray_xlong.trajectory import LossConfig

TRACKERS = ("wandb", "mlflow")
"""Trackers ``run.trackers`` may name (TensorBoard is always on)."""


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the field and its source."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunOptions:
    """What ``ray-xlong train`` does around the algorithm."""

    steps: int = 25
    """Optimizer steps to train."""
    seed: int = 1
    """Model, warm start, task and engine seed (``XLongConfig.debugging(seed)``)."""
    out: str = "out/train"
    """Where the timeline, event log, config and tracker files go."""
    workdir: str = ".cache/ray_xlong"
    """Model cache (the warm-started policy)."""
    trackers: tuple[str, ...] = ()
    """Experiment trackers besides TensorBoard: any of :data:`TRACKERS`."""
    project: str = "ray_xlong"
    """W&B project / MLflow experiment name."""

    def __post_init__(self) -> None:
        if not is_int(self.steps) or self.steps < 1:
            raise ConfigError(f"RunOptions.steps must be an int >= 1, got {self.steps!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"RunOptions.seed must be an int >= 0, got {self.seed!r}")
        for name in ("out", "workdir", "project"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"RunOptions.{name} must be a non-empty string, "
                                  f"got {getattr(self, name)!r}")
        unknown = [t for t in self.trackers if t not in TRACKERS]
        if unknown:
            raise ConfigError(f"RunOptions.trackers must name only {TRACKERS}, got {unknown}")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingOptions:
    """The ``XLongConfig.training(...)`` values a file may set."""

    lr: float = 5e-4
    """Adam learning rate."""
    grad_clip: float | None = 1.0
    """Global-norm gradient clip (None: no clip)."""
    train_batch_size_per_learner: int = 128
    """Runs per step (a multiple of ``xlong.runs_per_group``)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"TrainingOptions.lr must be > 0, got {self.lr!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"TrainingOptions.grad_clip must be > 0 or null, "
                              f"got {self.grad_clip!r}")
        if self.train_batch_size_per_learner < 1:
            raise ConfigError(f"TrainingOptions.train_batch_size_per_learner must be >= 1, "
                              f"got {self.train_batch_size_per_learner!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainSpec:
    """Everything ``ray-xlong train`` runs with (one section per component)."""

    run: RunOptions = RunOptions()
    """``run:`` section."""
    training: TrainingOptions = TrainingOptions()
    """``training:`` section."""
    xlong: XLongOptions = XLongOptions()
    """``xlong:`` section."""

    def algorithm_config(self, *, model_dir: str | None = None):
        """The ``XLongConfig`` (``model_dir`` overrides ``xlong.model_dir`` when given)."""
        from ray_xlong.rllib.algorithm_config import XLongConfig

        t, x = self.training, self.xlong
        if model_dir is not None:
            x = dataclasses.replace(x, model_dir=model_dir)
        config = (XLongConfig().debugging(seed=self.run.seed)
                  .training(lr=t.lr, grad_clip=t.grad_clip,
                            train_batch_size_per_learner=t.train_batch_size_per_learner))
        config.xlong_options = x
        return config

    def as_dict(self) -> dict[str, Any]:
        """Plain values (YAML-able; tuples become lists)."""
        return _plain(dataclasses.asdict(self))


SECTIONS = {"run": RunOptions, "training": TrainingOptions, "xlong": XLongOptions}
"""File sections and their dataclasses."""


def default_spec() -> TrainSpec:
    """The recipe ``ray-xlong train`` runs without a file: the lookup task on 2 local cells."""
    from ray_xlong.rllib.algorithm_config import RECIPE_HARNESS

    return TrainSpec(xlong=XLongOptions(cells=2, placement_strategy="PACK", engine="vllm",
                                        runs_per_group=8, staleness_bound=1,
                                        harness=RECIPE_HARNESS))


def load_spec(path: str | None = None, *, sets: Sequence[str] = (),
              flags: Mapping[str, Any] | None = None,
              base: TrainSpec | None = None) -> TrainSpec:
    """``base`` (default: :func:`default_spec`) ← the file ← ``flags`` ← ``sets``.

    Args:
        path: a YAML file (None: no file).
        sets: ``section.field[.sub]=value`` strings (value parsed as YAML).
        flags: ``{"section.field": value}`` from the command's own flags.
        base: the starting spec.

    Raises:
        ConfigError: names the field and ``FILE:LINE`` (or ``--set``) it came from.
    """
    spec, lines = base or default_spec(), {}
    if path is not None:
        data, lines = _read(path)
        spec = _apply(spec, data, lambda key: f"{path}:{lines.get(key, 1)}")
    for key, value in (flags or {}).items():
        spec = _apply(spec, _nest(key, value), lambda _k, key=key: f"--{key.split('.')[-1]}")
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not YAML: {exc}") from None
        spec = _apply(spec, _nest(key.strip(), value), lambda _k, item=item: f"--set {item}")
    runs, group = spec.training.train_batch_size_per_learner, spec.xlong.runs_per_group
    if runs % group:
        line = lines.get(("xlong", "runs_per_group")) or lines.get(
            ("training", "train_batch_size_per_learner"))
        source = f"{path}:{line}: " if line else ""
        raise ConfigError(f"{source}training.train_batch_size_per_learner ({runs} runs per "
                          f"step) must be a multiple of xlong.runs_per_group ({group})")
    return spec


def dump(spec: TrainSpec) -> str:
    """``spec`` as YAML (what ``--print-config`` prints; loads back to the same spec)."""
    return yaml.safe_dump(spec.as_dict(), sort_keys=False)


# -- reading and applying ------------------------------------------------------------------------
def _read(path: str) -> tuple[dict, dict[tuple[str, ...], int]]:
    """The file's mapping and the 1-based line of every key path."""
    try:
        with open(path) as f:
            text = f.read()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the file must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(data).__name__}")
    lines: dict[tuple[str, ...], int] = {}
    _lines(node, (), lines)
    return data, lines


def _lines(node: Any, prefix: tuple[str, ...], out: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            out[path] = key.start_mark.line + 1
            _lines(value, path, out)


def _nest(key: str, value: Any) -> dict:
    """``"a.b.c", v`` → ``{"a": {"b": {"c": v}}}``."""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _apply(spec: TrainSpec, data: Mapping, where) -> TrainSpec:
    changes = {}
    for name, body in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"{where((name,))}: unknown section {name!r}"
                              f"{_hint(name, SECTIONS)}; sections: {', '.join(SECTIONS)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{where((name,))}: {name} must be a mapping of fields, "
                              f"got {body!r}")
        changes[name] = _update(getattr(spec, name), body, (name,), where)
    return dataclasses.replace(spec, **changes)


NESTED = {"LossConfig": LossConfig, "HarnessConfig": HarnessConfig,
          "ShardingSettings": ShardingSettings, "EngineSettings": EngineSettings}
"""Field types that are dataclasses themselves (set as a mapping)."""


def _update(obj: Any, body: Mapping, path: tuple[str, ...], where) -> Any:
    """``obj`` with ``body``'s fields (checked, coerced); the dataclass validates the rest."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    values = {}
    for name, value in body.items():
        key = (*path, str(name))
        dotted = ".".join(key)
        if name not in fields:
            raise ConfigError(f"{where(key)}: {dotted}: unknown field{_hint(name, fields)}")
        kind = str(fields[name].type)
        if kind in NESTED:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where(key)}: {dotted} must be a mapping of "
                                  f"{kind} fields, got {value!r}")
            values[name] = _update(getattr(obj, name), value, key, where)
        else:
            values[name] = _coerce(value, kind, f"{where(key)}: {dotted}")
    try:
        return dataclasses.replace(obj, **values)
    except (ValueError, TypeError) as exc:
        field = _field_in(str(exc), fields)
        key = (*path, field) if field else path
        raise ConfigError(f"{where(key)}: {'.'.join(key)}: {exc}") from None


def _coerce(value: Any, kind: str, what: str) -> Any:
    """``value`` as the annotation ``kind`` says (int, float, str, bool, tuple[str, ...],
    tuple[float, ...], ``X | None``); a float field takes an int, or a number written as a
    string."""
    options = [k.strip() for k in kind.split("|")]
    if value is None:
        if "None" in options:
            return None
        raise ConfigError(f"{what} must be {kind}, got null")
    base = [k for k in options if k != "None"][0]
    if base == "bool" and isinstance(value, bool):
        return value
    if base == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base == "float" and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    if base == "str" and isinstance(value, str):
        return value
    if base.startswith("tuple[str") and isinstance(value, (list, tuple)) \
            and all(isinstance(v, str) for v in value):
        return tuple(value)
    if base.startswith("tuple[float") and isinstance(value, (list, tuple)) \
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    raise ConfigError(f"{what} must be {kind}, got {value!r} ({type(value).__name__})")


def _field_in(message: str, fields: Mapping[str, Any]) -> str | None:
    """The field a dataclass's validation message names (``Class.field must …``)."""
    for match in re.finditer(r"\b[A-Z]\w*\.(\w+)", message):
        if match.group(1) in fields:
            return match.group(1)
    return None


def _hint(name: Any, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
