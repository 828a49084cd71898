"""Collectives between cells (``cells/collectives.py``) on real gloo groups, no Ray: members
are threads of this process, each with its own ``ProcessGroupGloo`` on one ``TCPStore``.

An all-reduce gives every member Σ of the members' gradients ÷ total; a member that never comes
makes the others fail within the timeout with their gradients as they were; a holder's weights
and Adam state reach a joiner exactly; the driver's keys and the members' groups stay bounded
(LRU) and a failed set gets a new key."""

from __future__ import annotations

import threading

import pytest
import torch

from ray_xlong.cells.collectives import (PeerGroups, StateFrom, local, receive_state,
                                         reduce_gradients, send_state, state_tensors)
from ray_xlong.cells.weight_sync import SyncGroups, SyncSpec


class Owner:
    """Holds a member's groups (as a Learner actor does)."""


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def run_all(*calls):
    """Run each ``call()`` in its own thread; their results or exceptions, in order."""
    out: list = [None] * len(calls)

    def go(i, call):
        try:
            out[i] = call()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc
    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def peers():
    return PeerGroups(timeout_s=10.0, host="127.0.0.1")


def with_grads(seed: int) -> torch.nn.Module:
    m = model(0)
    torch.manual_seed(seed)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m


def test_all_reduce_gives_every_member_the_sum_over_total(peers):
    members = [with_grads(s) for s in (1, 2, 3)]
    want = {n: sum(dict(m.named_parameters())[n].grad for m in members) / 6.0
            for n, _ in members[0].named_parameters()}
    groups = peers.groups("reduce", (0, 2, 3))
    owners = [Owner() for _ in members]
    out = run_all(*[lambda m=m, o=o, g=g: reduce_gradients(m, o, g.spec(0, torch.device("cpu")),
                                                           6.0)
                    for m, o, g in zip(members, owners, groups.values())])
    assert all(isinstance(n, int) and n > 0 for n in out), out
    for m in members:
        for n, p in m.named_parameters():
            assert torch.allclose(p.grad, want[n], rtol=1e-6, atol=1e-7)


def test_a_member_that_never_comes_fails_the_others_with_their_gradients_untouched():
    peers = PeerGroups(timeout_s=2.0, host="127.0.0.1")
    members = [with_grads(s) for s in (1, 2)]
    before = [{n: p.grad.clone() for n, p in m.named_parameters()} for m in members]
    groups = peers.groups("reduce", (0, 1, 2))       # cell 2 never calls
    owners = [Owner(), Owner()]
    out = run_all(*[lambda m=m, o=o, c=c: reduce_gradients(m, o, groups[c].spec(
        0, torch.device("cpu")), 1.0) for m, o, c in zip(members, owners, (0, 1))])
    assert all(isinstance(e, Exception) for e in out), out
    for m, b in zip(members, before):
        for n, p in m.named_parameters():
            assert torch.equal(p.grad, b[n])
    assert all(o._sync_groups_collectives.aborted == 1 for o in owners)


def test_a_joiner_loads_the_holders_weights_and_adam_state_exactly(peers):
    holder, joiner = model(0), model(1)
    opt = torch.optim.Adam(holder.parameters(), lr=1e-2)
    for _ in range(2):
        holder(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    fresh = torch.optim.Adam(joiner.parameters(), lr=1e-2)
    groups = peers.groups("state", (0, 1))
    cpu = torch.device("cpu")
    out = run_all(lambda: send_state(holder, opt, Owner(), groups[0].spec(0, cpu), 2),
                  lambda: receive_state(joiner, fresh, Owner(), groups[1].spec(0, cpu), 2))
    assert out[0] > 0 and out[1] is None, out
    got, want = state_tensors(joiner, fresh), state_tensors(holder, opt)
    assert set(got) == set(want) and any(k.endswith("/exp_avg_sq") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randn(3, 4)        # one more identical step on both: same weights
    for m, o in ((holder, opt), (joiner, fresh)):
        m(x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(holder.parameters(), joiner.parameters()))
    assert StateFrom(groups[1], 2).group.position == 1 and local(x) is x


def test_keys_are_reused_per_set_bounded_and_renewed_after_a_failure():
    peers = PeerGroups(host="127.0.0.1", limit=2)
    first = peers.groups("reduce", (0, 1))[0].key
    assert peers.groups("reduce", (0, 1))[1].key == first
    assert peers.groups("state", (0, 1))[0].key != first      # kinds do not share groups
    peers.groups("reduce", (1, 2))                           # evicts the least recent set
    assert peers.groups("reduce", (0, 1))[0].key != first
    again = peers.groups("reduce", (1, 2))[1].key
    peers.failed("reduce", (1, 2))
    assert peers.groups("reduce", (1, 2))[1].key != again and peers.failures == 1


def test_a_new_driver_never_issues_a_key_of_an_earlier_one():
    """Members keep their groups past a driver (the mode benchmarks run one actuator after
    another on the same cells): a key issued again would find a group on a closed store."""
    first, second = PeerGroups(host="127.0.0.1"), PeerGroups(host="127.0.0.1")
    for kind, cells in (("state", (0, 2)), ("reduce", (0, 1))):
        assert first.groups(kind, cells)[0].key != second.groups(kind, cells)[0].key
    assert first.groups("state", (0, 2))[0].key.startswith("0/")    # generation 0


def test_a_members_groups_stay_within_its_limit_least_recent_out():
    store = PeerGroups(host="127.0.0.1")                     # its TCPStore hosts them
    groups = SyncGroups(limit=2)
    specs = [SyncSpec(f"0/x/{i}", "127.0.0.1", store.port, 0, 1, timeout_s=5.0)
             for i in range(3)]
    for spec in (specs[0], specs[1], specs[0], specs[2]):
        groups.group(spec)
    assert list(groups.groups) == ["0/x/0", "0/x/2"]
