"""Recovery (``cells/recovery.py``) driven by the real actuator on in-process fakes, no Ray:
a runner lost (its spooled runs delivered, its live runs restarted in place), a learner lost
mid-step (its micro-batches requeued, the step's update unchanged: nothing trained twice) or as
the reduce begins (the survivors' gradients banked), a node lost (the cell retired, its live
runs restarted on other cells, the payloads of its ended untrained runs rebuilt from the spool;
the cell rebuilt once its node is back), a rebuilt Learner's state source lost on a node Ray
has not marked dead yet (the state taken from elsewhere), and an actor error that is not a
death (``CellActorDied``).

Every job must end with the cell invariants holding (``metrics.check_invariants``) and every
ended run in exactly one applied update (the fake learners' ledger).
"""

from __future__ import annotations

import pytest
import ray

from fakes import FakeJob, FakeRay, OnceWhen, fake_config
from ray_xlong.cells.metrics import check_invariants
from ray_xlong.cells.records import CellActorDied
from ray_xlong.cells.runs import run_index


@pytest.fixture(autouse=True)
def no_ray():
    yield
    assert not ray.is_initialized(), "a unit test of the cell runtime started Ray"


def audit(job: FakeJob, result, *, bound: int = 1) -> None:
    """Invariants hold; every trained run is in exactly one applied update, every member
    applied the same update."""
    assert check_invariants(result, staleness_bound=bound) == []
    trained = [r for step in result.trained_runs for r in step]
    assert len(trained) == job.cfg.job.total_runs
    assert job.ledger.trained() == {r: 1 for r in trained}
    assert job.ledger.consistent()


def test_a_job_on_fakes_trains_every_run_once(tmp_path):
    job = FakeJob.make(fake_config(tmp_path))
    result = job.actuator().run()
    audit(job, result)
    assert result.faults == () and job.pool.actors_replaced == 0


def _kill_runner_after_a_spooled_end(act):
    """Once 2 runs ended, the first cell in rollout with 2+ live runs: end one into the spool
    (unreported), kill the runner. Returns (cell, runs spooled, runs to restart)."""
    if act.runs_ended() < 2:
        return None
    for cell in range(len(act.cells)):
        runner = act.pool.runner(cell)
        if act.m.role[cell].value == "rollout" and len(runner.live) >= 2:
            runner.end_now(sorted(runner.live)[0])
            spooled = {r.run_id for r in runner.ended}
            act.cells[cell].runner.kill()
            return cell, spooled, set(runner.live)
    return None


def test_runner_lost_spooled_runs_delivered_live_runs_restarted(tmp_path):
    job = FakeJob.make(fake_config(tmp_path), polls=3)
    act = job.actuator()
    act.injector = OnceWhen(_kill_runner_after_a_spooled_end)
    result = act.run()
    assert act.injector.fired, "no cell had two live runs"
    cell, spooled, live = act.injector.fired
    (f,) = result.faults
    assert (f.kind, f.cell, f.retired) == ("runner", cell, False)
    assert (f.runs_from_spool, f.runs_rerun) == (len(spooled), len(live))
    assert spooled <= set(job.pool.runner(cell).spool_reads)  # the new runner processed them
    restarted = {e.run for e in result.events if e.kind == "run_restarted"}
    assert restarted == {run_index(r) for r in live}
    assert job.pool.actors_replaced == 1
    audit(job, result)


def test_learner_lost_mid_step_requeues_its_micro_batches(tmp_path):
    job = FakeJob.make(fake_config(tmp_path))
    act = job.actuator()

    def kill_learner(a):   # a member mid micro-batch that trained one before
        for cell in a.learners.members if a.learners else ():
            if cell in a.in_flight and len(a.learners.held[cell]) >= 2:
                a.cells[cell].learner.kill()
                return cell, len(a.learners.held[cell])
        return None

    act.injector = OnceWhen(kill_learner)
    result = act.run()
    assert act.injector.fired, "no member trained two micro-batches of one step"
    cell, held = act.injector.fired
    (f,) = result.faults
    assert (f.kind, f.cell, f.micro_batches_redone) == ("learner", cell, held)
    audit(job, result)        # each run once in the update: the redone ones are not doubled


def test_node_lost_cell_retired_runs_restarted_elsewhere_payloads_from_spool(tmp_path):
    job = FakeJob.make(fake_config(tmp_path, steps=4), polls=3)
    act = job.actuator()

    def lose_node(a):   # a cell with live runs and ended, untrained runs on it
        for cell in range(len(a.cells)):
            held = {r for r, e in a.state.held_runs.items() if e.cell == cell}
            if a.m.live[cell] and held:
                live = set(a.m.live[cell])
                job.pool.lose_node(cell)
                return cell, held, live
        return None

    def restore(a):
        if act.injector.ticks_after == 5:
            job.pool.restore_node(act.injector.fired[0])

    act.injector = OnceWhen(lose_node, then=restore)
    result = act.run()
    assert act.injector.fired, "no cell had live runs and ended untrained runs at once"
    cell, held, live = act.injector.fired
    node = [f for f in result.faults if f.kind == "node"]
    assert [(f.cell, f.retired, f.runs_rerun) for f in node] == [(cell, True, len(live))]
    restarted = [e for e in result.events if e.kind == "run_restarted"]
    assert {e.run for e in restarted} == live and all(e.cell != cell for e in restarted)
    reads = {r for c in range(len(act.cells)) if c != cell
             for r in job.pool.runner(c).spool_reads}
    assert held <= reads                      # payloads rebuilt by another cell's runner
    assert [f.kind for f in result.faults if f.cell == cell] == ["node", "node_returned"]
    assert cell not in act.retired
    audit(job, result)


def test_an_actor_error_that_is_not_a_death_fails_loudly(tmp_path):
    job = FakeJob.make(fake_config(tmp_path))
    act = job.actuator()

    def refuse(a):        # the runner refuses its next runs (draining) but stays alive
        if a.runs_ended() >= 1:
            a.pool.runner(0).draining = True
            return 0
        return None

    act.injector = OnceWhen(refuse)
    with pytest.raises(CellActorDied, match="cell 0: started failed"):
        act.run()


def test_learner_lost_before_the_reduce_banks_the_survivors_gradients(tmp_path):
    """A member dies as the step's reduce begins (after its micro-batches): ``finish`` finds
    it gone, keeps the survivors' gradients (banked), and its micro-batches are trained again
    by the members left — the update still holds every run once."""
    job = FakeJob.make(fake_config(tmp_path, steps=4))
    act = job.actuator()
    killed = []

    def patch_finish(a):
        if a.learners is None:
            return None
        group, finish = a.learners, a.learners.finish

        def finish_killing_one():
            if not killed and len(group.members) >= 2:
                cell = max(group.members, key=lambda c: len(group.held[c]))
                killed.append((cell, len(group.held[cell])))
                a.cells[cell].learner.kill()
            return finish()
        group.finish = finish_killing_one
        return True

    act.injector = OnceWhen(patch_finish)
    result = act.run()
    assert killed, "no step had two members"
    (cell, held), (f,) = killed[0], result.faults
    assert (f.kind, f.cell, f.why) == ("learner", cell, "lost during the step's reduce")
    assert held >= 1
    audit(job, result)


def test_every_holder_of_the_state_lost_reloads_the_checkpoint_and_replays(tmp_path):
    """The driver keeps no copy of the state: when every Learner
    that holds the current version is lost, a new Learner loads the last checkpoint (version 2)
    and replays the step since (2 → 3) from the spool — the same runs, the same update — and the
    job ends with every run trained once."""
    job = FakeJob.make(fake_config(tmp_path, checkpoint=True, steps=5, checkpoint_every=2))
    act = job.actuator()
    s = act.state

    def lose_every_holder(a):
        g = a.learners
        if g is None or g.version != 3 or s.checkpoint_ref is None:
            return None
        s.ray.get(s.checkpoint_ref)            # version 2 is on disk (fakes write lazily)
        g.kept = None                  # no object-store copy either: the state lives on its holders
        holders = a.recovery.holders()
        for c in holders:
            a.cells[c].learner.kill()
        return holders, dict(job.ledger.applied[3][0])

    act.injector = OnceWhen(lose_every_holder)
    result = act.run()
    assert act.injector.fired, "the job never reached version 3 with a checkpoint started"
    _, update3 = act.injector.fired
    (state,) = [f for f in result.faults if f.kind == "state"]
    assert "reloaded version 2, replayed 1 steps" in state.why
    assert state.runs_from_spool == len(result.trained_runs[2])
    assert job.ledger.applied[3][-1] == update3      # the replayed update is the lost one
    audit(job, result)


def test_the_state_lost_without_a_checkpoint_fails_loudly(tmp_path):
    job = FakeJob.make(fake_config(tmp_path, steps=3))
    act = job.actuator()

    def lose_every_holder(a):
        g = a.learners
        if g is None or g.version != 1:
            return None
        g.kept = None
        for c in a.recovery.holders():
            a.cells[c].learner.kill()
        return True

    act.injector = OnceWhen(lose_every_holder)
    with pytest.raises(CellActorDied, match="no checkpoint to reload"):
        act.run()


def test_the_node_of_the_only_holder_lost_reloads_instead_of_loading_its_lost_copy(tmp_path):
    """A step with one member leaves its state in that member's node's object store (the
    group's kept copy and weights). That node lost and back: the rebuilt cell must not load the
    lost copy (forever: a hung job in CI) but the last checkpoint, replaying the steps since."""
    job = FakeJob.make(fake_config(tmp_path, cells=2, checkpoint=True, steps=5))
    act = job.actuator()
    s = act.state

    def lose_the_only_holder(a):
        g = a.learners
        if g is None or g.version < 2 or s.checkpoint_ref is None:
            return None
        holders = a.recovery.holders()
        if len(holders) != 1 or g.kept is None or g.kept[0] != g.version:
            return None
        s.ray.get(s.checkpoint_ref)
        job.pool.lose_node(holders[0])
        return holders[0]

    def restore(a):
        if act.injector.ticks_after == 5:
            job.pool.restore_node(act.injector.fired)

    act.injector = OnceWhen(lose_the_only_holder, then=restore)
    result = act.run()
    assert act.injector.fired is not None, "no step ended with one holder and a checkpoint"
    cell = act.injector.fired
    assert [f.kind for f in result.faults if f.cell == cell][:1] == ["node"]
    assert "node_returned" in [f.kind for f in result.faults if f.cell == cell]
    assert any(f.kind == "state" and "reloaded version" in f.why for f in result.faults)
    audit(job, result)


def test_a_returned_cell_whose_state_load_is_lost_every_time_fails_naming_the_cell(tmp_path):
    """A returned node's cell loads the state into its new Learner; a load lost every time (the
    source gone for good, whichever it is) moves on to the next source — another holder, then
    the checkpoint — and, with none left, the job fails naming the cell: it never spins (the
    fault suite's node job once hung 1,400 s in CI)."""
    from fakes import FakeObjectLost

    job = FakeJob.make(fake_config(tmp_path, steps=4), polls=3)
    act = job.actuator()
    spawn = job.pool._spawn

    def lost_on_load(cell, which):
        actor = spawn(cell, which)
        if which == "learner" and cell == act.injector.fired:
            def set_xlong_state(state):
                raise FakeObjectLost("the state's source is gone")
            actor.obj.set_xlong_state = set_xlong_state
        return actor

    def lose_node(a):
        for cell in range(len(a.cells)):
            if a.m.live[cell]:
                job.pool.lose_node(cell)
                job.pool._spawn = lost_on_load
                return cell
        return None

    def restore(a):
        if act.injector.ticks_after == 3:
            job.pool.restore_node(act.injector.fired)

    act.injector = OnceWhen(lose_node, then=restore)
    with pytest.raises(CellActorDied, match=r"cell \d's new learner found no holder of the "
                                            r"state: every holder .* is lost and there is no "
                                            r"checkpoint to reload"):
        act.run()
    assert act.recovery.lost_rebuilds.get(act.injector.fired, 0) <= 3


def _fail_the_first_wake_up_behind(monkeypatch, error: Exception) -> list[int]:
    """The first wake-up that brings a state (a cell joining behind) raises ``error`` instead;
    returns a list that gets that Learner's version once it fired."""
    from fakes import FakeLearner

    fired: list[int] = []
    wake_up = FakeLearner.wake_up

    def failing(self, state=None, after=None):
        if state is not None and int(state["version"]) != self.version and not fired:
            fired.append(self.version)
            raise error
        return wake_up(self, state, after)

    monkeypatch.setattr(FakeLearner, "wake_up", failing)
    return fired


def _kill_at_the_first_pending(kind: str, actor: str, also=lambda a, p: True):
    """An injector action: once a step applied, kill ``actor`` (runner / learner) of the
    first cell with a pending call of ``kind`` (and ``also(actuator, pending)``); returns it."""
    def action(a):
        if a.learners is None or a.learners.version < 1:
            return None
        for p in list(a.state.pending.values()):
            if p.kind == kind and also(a, p):
                getattr(a.cells[p.cell], actor).kill()
                return p.cell
        return None
    return action


def test_a_joiners_broken_state_transfer_rebuilds_its_learner_not_the_driver(tmp_path,
                                                                              monkeypatch):
    """A cell joins a step behind: its Learner loads the state from a holder, and the holder's
    end of the transfer is lost mid-way (gloo: "connection closed by peer"). The Learner is
    alive, its state unchanged (or, sharded, partly loaded): it is stopped and rebuilt on the
    state of a live holder, the step goes on — before, the driver failed (CellActorDied) and a
    new one resumed from the checkpoint."""
    from ray_xlong.cells.collectives import PeerTransferError

    broke = _fail_the_first_wake_up_behind(monkeypatch, PeerTransferError(
        "the state of version 2 from its holder did not arrive: Connection closed by peer"))
    job = FakeJob.make(fake_config(tmp_path, steps=5))
    result = job.actuator().run()
    assert broke, "no cell joined a step behind"
    (f,) = [f for f in result.faults if "state did not arrive" in f.why]
    assert f.kind == "transfer" and not f.retired
    assert job.pool.actors_replaced == 1
    audit(job, result)


def test_a_joiners_lost_state_copy_rebuilds_its_learner_on_a_fresh_copy(tmp_path, monkeypatch):
    """The object-store copy of the state a joining cell loads went with a node (Ray:
    ``ObjectReconstructionFailedError`` in ``wake_up``), both of the cell's actors alive. The
    copies are forgotten and made again from a live holder; the joiner's Learner is rebuilt on
    one — before, recovery found both actors alive and failed the driver."""
    from fakes import FakeObjectLost

    lost = _fail_the_first_wake_up_behind(
        monkeypatch, FakeObjectLost("the state's copy was lost with its node"))
    job = FakeJob.make(fake_config(tmp_path, steps=5))
    result = job.actuator().run()
    assert lost, "no cell joined a step behind"
    (f,) = [f for f in result.faults if "state did not arrive" in f.why]
    assert f.kind == "transfer" and not f.retired
    audit(job, result)


def test_a_switch_that_fails_with_its_runner_leaves_the_learner_behind_and_reloads_it(tmp_path):
    """A cell joins a step behind and its runner dies during the switch: the Learner's wake-up
    (chained on the runner's suspend) never runs, so it still holds its old version. The join
    had counted it a holder of the new one; the failed switch takes that back, and the rejoin
    brings the state along — else the cell trains on old weights and the step fails on the
    Learner's version check."""
    job = FakeJob.make(fake_config(tmp_path, steps=5))
    act = job.actuator()
    act.injector = OnceWhen(_kill_at_the_first_pending(
        "switch", "runner", also=lambda a, p: a.learners.brings_state(p.cell)))
    result = act.run()
    assert act.injector.fired is not None, "no cell joined a step behind"
    assert [f.kind for f in result.faults if f.cell == act.injector.fired][:1] == ["runner"]
    audit(job, result)


def test_a_sync_that_fails_with_its_learner_is_redone_on_the_rebuilt_learner(tmp_path):
    """A cell goes back to rollout (its runner loads the new weights once its Learner slept)
    and the Learner dies meanwhile: the sync, chained on the Learner's sleep, fails. The
    Learner is rebuilt and the sync redone — the cell serves the new weights, and its runs'
    tokens stay within the staleness bound."""
    job = FakeJob.make(fake_config(tmp_path, steps=5))
    act = job.actuator()
    act.injector = OnceWhen(_kill_at_the_first_pending("sync", "learner"))
    result = act.run()
    assert act.injector.fired is not None, "no cell synced"
    assert [f.kind for f in result.faults if f.cell == act.injector.fired][:1] == ["learner"]
    audit(job, result)


class LateDeathRay(FakeRay):
    """Ray marks an actor dead only once its node's loss is detected (missed heartbeats: ~30 s
    in the chaos run): until then ``alive`` is True for the actors in ``undetected`` and
    ``wait`` does not return their calls (they hang)."""

    def __init__(self) -> None:
        super().__init__()
        self.undetected: set = set()

    def alive(self, actor) -> bool:
        return actor in self.undetected or super().alive(actor)

    def wait(self, refs, *, num_returns, timeout):
        hang = [r for r in refs if r.actor is not None and r.actor in self.undetected]
        free = [r for r in refs if r not in hang]
        ready, rest = super().wait(free, num_returns=min(num_returns, len(free)),
                                   timeout=timeout)
        return ready, rest + hang


def test_a_rebuilt_learner_whose_state_source_is_lost_loads_from_another(tmp_path):
    """A Learner lost mid-step is rebuilt on the state of a live holder; when that holder's
    node is gone but Ray has not marked it dead yet, the state it hands out is lost. The
    rebuild takes the state from another source (a holder, the kept copy, or the checkpoint;
    the 5-minute chaos run's driver crash: 'lost again while rebuilding, but both actors are
    alive')."""
    cfg = fake_config(tmp_path, steps=6, checkpoint=True)
    job = FakeJob.make(cfg)
    job.ray = job.pool.ray = LateDeathRay()
    act = job.actuator()

    def kill_learner_and_its_source(a):
        g = a.learners
        if g is None or g.version < 1:
            return None
        for cell in g.members:
            others = [c for c in g._by_preference(g.holders()) if c != cell]
            if cell in a.in_flight and others:
                source = others[0]                  # the holder state_ref picks
                a.state.ray.get(a.state.checkpoint_ref)   # on disk (fakes write lazily)
                job.pool.lose_node(source)
                c = a.cells[source]
                job.ray.undetected |= {c.runner, c.learner}
                a.cells[cell].learner.kill()
                return cell, source
        return None

    def detect_then_restore(a):
        if act.injector.ticks_after == 3:
            job.ray.undetected.clear()             # Ray marks the node's actors dead
        if act.injector.ticks_after == 10:
            job.pool.restore_node(act.injector.fired[1])

    act.injector = OnceWhen(kill_learner_and_its_source, then=detect_then_restore)
    result = act.run()
    assert act.injector.fired, "no member mid micro-batch with another holder"
    cell, source = act.injector.fired
    kinds = [(f.kind, f.cell) for f in result.faults]
    assert ("learner", cell) in kinds and ("node", source) in kinds
    audit(job, result)


def test_a_holder_lost_before_a_joiner_loaded_its_state_is_not_taken_for_the_joiner(tmp_path):
    """A cell joins a step behind (its wake-up will load the state from the one holder) and
    the holder's Learner dies before that load ran. The joiner is no holder until its load
    succeeded: the holder's rebuild takes the state from the kept copy or the checkpoint —
    before, it took it from the joiner, whose failed load left it on the old version, and two
    Learners the driver counted current trained on old weights (the version check failed the
    driver: the intermittent failure of the fault suite's together job)."""
    job = FakeJob.make(fake_config(tmp_path, steps=5, checkpoint=True))
    act = job.actuator()

    def kill_holder(a):
        g = a.learners
        loading = [c for c in g.members if g.brings_state(c)] if g and g.step >= 0 else []
        holders = [c for c in range(len(a.cells)) if c not in loading
                   and g.learner_version[c] == g.version and not a.cells[c].learner.dead]
        if loading and holders:
            a.cells[holders[0]].learner.kill()
            return holders[0]
        return None

    act.injector = OnceWhen(kill_holder)
    result = act.run()
    assert act.injector.fired is not None, "no holder alongside a loading joiner"
    assert ("learner", act.injector.fired) in [(f.kind, f.cell) for f in result.faults]
    audit(job, result)


def test_a_training_cell_behind_loads_before_it_trains_and_a_failed_load_is_recovered(
        tmp_path):
    """A cell idle in training (the async mode's pool) whose Learner holds an unknown version
    (``replace``: as after a member's reduce failed without its death) starts or joins the
    next step: its wake-up brings the state, and it takes no micro-batch before that load
    succeeded. Here the load fails (its source's Learner dies first): the failed load is
    recovered like a failed switch (the cell's Learner rebuilt on the checkpoint) — before,
    that wake-up was not watched, and the cell trained on its old version (the driver
    failed)."""
    from ray_xlong.scheduling import Role

    job = FakeJob.make(fake_config(tmp_path, mode="async", steps=5, checkpoint=True))
    act = job.actuator()
    killed: list[int] = []

    def forget_a_holder(a):
        g = a.learners
        if g is None or g.step >= 0:
            return None
        idle = [c for c in g.holders() if a.m.role[c] is Role.TRAINING]
        if len(g.holders()) < 2 or not idle:
            return None
        g.replace(idle[0], a.cells[idle[0]].learner)     # its version unknown from now on
        return idle[0]

    def kill_its_source(a):
        g, cell = a.learners, act.injector.fired
        if killed or not (g.step >= 0 and cell in g.members and g.brings_state(cell)):
            return
        assert cell not in a.state.awake        # no micro-batch before its state loaded
        source = [c for c in g.holders() if c != cell][0]
        a.cells[source].learner.kill()
        killed.append(source)

    act.injector = OnceWhen(forget_a_holder, then=kill_its_source)
    result = act.run()
    assert act.injector.fired is not None and killed, "the forgotten holder never joined"
    cell = act.injector.fired
    assert any(f.cell == cell and "state did not arrive" in f.why for f in result.faults)
    audit(job, result)
