"""The front door's session table as a pure object: ids, re-opens, per-client limits, reconciliation."""
import time

import pytest

from hybridspec.cloud.routing import SessionTable
from hybridspec.common.errors import FailedPrecondition, ResourceExhausted


def routed(table: SessionTable, client: str, replica: str, opening: bool = False) -> str:
    """A new session of `client`, placed on `replica` (as Backend.open_session does)."""
    sid, route = table.claim("", client)
    route.replica, route.opening = replica, opening
    return sid


def test_new_ids_are_fresh_and_a_live_id_reopens_in_place():
    table = SessionTable(max_per_client=8)
    sid, route = table.claim("", "a")
    assert route.replica == "" and len(sid) == 24  # counted at once, placed later
    assert table.claim(sid, "anyone") == (sid, route)  # presenting the id is holding the session
    made_up, other = table.claim("my-own-id", "a")
    assert other is not route and made_up not in (sid, "my-own-id")
    with pytest.raises(FailedPrecondition) as info:
        table.get("my-own-id")
    assert "my-own-id" not in str(info.value)


def test_the_limit_counts_from_the_claim_and_is_freed_by_removal():
    table = SessionTable(max_per_client=2)
    first, _ = table.claim("", "a")  # not placed yet (every replica down, say): it counts already
    routed(table, "a", "r1")
    with pytest.raises(ResourceExhausted):
        table.claim("", "a")
    table.claim("", "b")  # another client is not affected
    table.remove(first)
    table.claim("", "a")  # room again
    assert table.count("r1") == 1


def test_reconcile_drops_only_settled_routes_the_replica_no_longer_holds():
    table = SessionTable(max_per_client=8)
    gone, kept = routed(table, "a", "r0"), routed(table, "a", "r0")
    opening = routed(table, "a", "r0", opening=True)  # the replica may not list it yet
    asked_at = time.monotonic()
    late = routed(table, "a", "r0")  # routed after the replica was asked
    assert table.reconcile("r0", {kept}, asked_at) == 1
    assert table.lookup(gone) is None and all(table.lookup(s) for s in (kept, opening, late))
    assert table.unrouted("r0", {kept, "stray"}) == ["stray"]
    assert table.unrouted("r1", {kept}) == [kept]  # held by r1 but routed to r0
