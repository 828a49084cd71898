"""Online forecast: the ``forecast`` mode with its inputs learned from the job's own events.

:class:`~ray_xlong.scheduling.forecast.ForecastPolicy` needs two numbers: the groups one
training cell trains per hour and the run horizon. A real job knows neither in advance, so
this policy learns both from its event log (:class:`~ray_xlong.scheduling.estimates.
EventEstimator`, fed through ``observe`` by the settle loop):

* groups per cell-time = 1 ÷ the median training cell-time per group of the last steps;
* horizon = the longest run seen (or the oldest live run's age when longer).

Until ``min_steps`` steps have ended it runs as :class:`~ray_xlong.scheduling.elastic.
ElasticPolicy` (no throughput is known before a step trained); then every decision is the
forecast policy's with the current estimates. Switching is safe at any instant: both read only
the snapshot, and the cell machine never lets a move interrupt a live run.

State: the estimator (the policy is not pure: build a new one per job, ``make_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.estimates import EventEstimator
from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.moves import Move
from ray_xlong.scheduling.state import ClusterState


@dataclass(slots=True)
class OnlineForecastPolicy:
    """``forecast`` with learned inputs; ``elastic`` until ``min_steps`` steps ended."""

    min_steps: int = 1
    """Steps to see before the forecast takes over (>= 1)."""
    name: str = "forecast_online"
    """Mode name in tables and logs."""
    estimator: EventEstimator = field(default_factory=EventEstimator)
    """What the job's events say so far."""
    warmup: ElasticPolicy = field(default_factory=ElasticPolicy)
    """The policy until the estimates exist."""

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"OnlineForecastPolicy.min_steps: must be >= 1, got {self.min_steps}")

    def observe(self, events) -> None:
        """New events of the log (the settle loop calls this before every decision)."""
        self.estimator.observe(events)

    def inputs(self, state: ClusterState) -> tuple[float, float] | None:
        """``(train_groups_per_cell_h, horizon_h)`` learned so far, or None (still elastic)."""
        per_group = self.estimator.train_per_group(state.config.batch_groups)
        horizon = self.estimator.horizon(state.time)
        if per_group is None or self.estimator.steps_ended < self.min_steps or \
                per_group <= 0 or horizon <= 0:
            return None
        return 1.0 / per_group, horizon

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """Elastic until the inputs are known, then forecast with the current inputs."""
        if self.estimator.group_size is None:
            self.estimator.configure(state.config.batch_groups, state.config.runs_per_group)
        learned = self.inputs(state)
        if learned is None:
            return self.warmup.decide(state, event)
        per_h, horizon = learned
        return ForecastPolicy(train_groups_per_cell_h=per_h, horizon_h=horizon,
                              name=self.name).decide(state, event)
