"""The front door's session table as a pure object: ids, re-opens, per-client limits, ownership,
reconciliation."""
import time

import pytest

from hybridspec.cloud.pool.routing import SessionTable
from hybridspec.common.security.credentials import Identity, anonymous
from hybridspec.common.protocol.errors import FailedPrecondition, PermissionDenied, ResourceExhausted

ALICE, BOB = Identity("alice", authenticated=True), Identity("bob", authenticated=True)


def routed(table: SessionTable, client: str, replica: str, opening: bool = False) -> str:
    """A new session of `client`, placed on `replica` (as Pool.open_session does)."""
    sid, route = table.claim("", anonymous(client))
    route.replica, route.opening = replica, opening
    return sid


def test_new_ids_are_fresh_and_a_live_id_reopens_in_place():
    table = SessionTable(max_per_client=8, max_per_address=8)
    sid, route = table.claim("", anonymous("a"))
    assert route.replica == "" and len(sid) == 24  # counted at once, placed later
    # Without credentials, presenting the id is holding the session.
    assert table.claim(sid, anonymous("anyone")) == (sid, route)
    made_up, other = table.claim("my-own-id", anonymous("a"))
    assert other is not route and made_up not in (sid, "my-own-id")
    with pytest.raises(FailedPrecondition) as info:
        table.get("my-own-id")
    assert "my-own-id" not in str(info.value)


def test_anonymous_and_token_limits_are_apart():
    """Callers without a token are limited per address, identities by their token's limit."""
    table = SessionTable(max_per_client=1, max_per_address=3)
    for _ in range(3):
        table.claim("", anonymous("ipv4:127.0.0.1"))
    with pytest.raises(ResourceExhausted, match="without a token from ipv4:127.0.0.1 already hold 3"):
        table.claim("", anonymous("ipv4:127.0.0.1"))
    table.claim("", Identity("alice", authenticated=True))
    with pytest.raises(ResourceExhausted, match="limit is 1"):
        table.claim("", Identity("alice", authenticated=True))
    table.claim("", Identity("bob", authenticated=True, max_sessions=2))
    table.claim("", Identity("bob", authenticated=True, max_sessions=2))


def test_the_limit_counts_from_the_claim_and_is_freed_by_removal():
    table = SessionTable(max_per_client=9, max_per_address=2)
    first, _ = table.claim("", anonymous("a"))  # not placed yet (every replica down, say): it counts already
    routed(table, "a", "r1")
    with pytest.raises(ResourceExhausted):
        table.claim("", anonymous("a"))
    table.claim("", anonymous("b"))  # another client is not affected
    table.remove(first)
    table.claim("", anonymous("a"))  # room again
    assert table.count("r1") == 1


def test_an_authenticated_session_belongs_to_its_identity():
    table = SessionTable(max_per_client=8, max_per_address=8)
    sid, route = table.claim("", ALICE)
    assert table.claim(sid, ALICE) == (sid, route) and table.get(sid, ALICE.owner) is route
    for attempt in (lambda: table.claim(sid, BOB), lambda: table.get(sid, BOB.owner)):
        with pytest.raises(PermissionDenied):
            attempt()
    assert table.lookup(sid) is route  # a refused caller changes nothing


def test_an_identity_may_carry_its_own_session_limit():
    table = SessionTable(max_per_client=8, max_per_address=8)
    small = Identity("small", authenticated=True, max_sessions=1)
    table.claim("", small)
    with pytest.raises(ResourceExhausted, match="the limit is 1"):
        table.claim("", small)
    for _ in range(8):
        table.claim("", ALICE)  # the server's default for everyone else


def test_reconcile_drops_only_settled_routes_the_replica_no_longer_holds():
    table = SessionTable(max_per_client=8, max_per_address=8)
    gone, kept = routed(table, "a", "r0"), routed(table, "a", "r0")
    opening = routed(table, "a", "r0", opening=True)  # the replica may not list it yet
    asked_at = time.monotonic()
    late = routed(table, "a", "r0")  # routed after the replica was asked
    assert table.reconcile("r0", {kept}, asked_at) == 1
    assert table.lookup(gone) is None and all(table.lookup(s) for s in (kept, opening, late))
    assert table.unrouted("r0", {kept, "stray"}) == ["stray"]
    assert table.unrouted("r1", {kept}) == [kept]  # held by r1 but routed to r0


def test_a_lost_replica_takes_its_settled_routes_and_their_counts_with_it():
    table = SessionTable(max_per_client=8, max_per_address=3)
    gone = [routed(table, "a", "r0"), routed(table, "a", "r0")]
    reopening = routed(table, "a", "r0", opening=True)  # its open fails too and places it again
    elsewhere = routed(table, "b", "r1")
    assert table.lost("r0") == 2
    assert all(table.lookup(s) is None for s in gone)
    assert table.lookup(reopening).replica == "r0" and table.lookup(elsewhere).replica == "r1"
    table.claim("", anonymous("a"))  # the lost sessions' slots are free again
    table.claim("", anonymous("a"))
    with pytest.raises(ResourceExhausted):
        table.claim("", anonymous("a"))
