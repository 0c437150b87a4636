"""The front door's session table as a pure object: ids, re-opens, per-client limits, reconciliation."""
import time

import pytest

from hybridspec.cloud.routing import SessionTable
from hybridspec.common.errors import FailedPrecondition, ResourceExhausted


def test_new_ids_are_fresh_and_a_live_id_reopens_in_place():
    table = SessionTable(max_per_client=8)
    sid, route = table.claim("", "a")
    assert route is None and len(sid) == 24
    added = table.add(sid, "r0", "a")
    assert table.claim(sid, "anyone") == (sid, added)  # presenting the id is holding the session
    made_up, route = table.claim("my-own-id", "a")
    assert route is None and made_up not in (sid, "my-own-id")
    with pytest.raises(FailedPrecondition) as info:
        table.get("my-own-id")
    assert "my-own-id" not in str(info.value)


def test_the_limit_is_per_client_and_freed_by_removal():
    table = SessionTable(max_per_client=2)
    first = table.claim("", "a")[0]
    table.add(first, "r0", "a")
    second = table.claim("", "a")[0]
    table.add(second, "r1", "a")
    with pytest.raises(ResourceExhausted):
        table.claim("", "a")
    table.claim("", "b")  # another client is not affected
    table.remove(first)
    table.claim("", "a")  # room again
    assert table.count("r0") == 0 and table.count("r1") == 1


def test_reconcile_drops_only_settled_routes_the_replica_no_longer_holds():
    table = SessionTable(max_per_client=8)
    gone, kept, opening = (table.claim("", "a")[0] for _ in range(3))
    for sid in (gone, kept):
        table.add(sid, "r0", "a").opening = False
    table.add(opening, "r0", "a")  # still opening: the replica may not list it yet
    asked_at = time.monotonic()
    late = table.claim("", "a")[0]
    table.add(late, "r0", "a").opening = False  # routed after the replica was asked
    assert table.reconcile("r0", {kept}, asked_at) == 1
    assert table.lookup(gone) is None and all(table.lookup(s) for s in (kept, opening, late))
    assert table.unrouted("r0", {kept, "stray"}) == ["stray"]
    assert table.unrouted("r1", {kept}) == [kept]  # held by r1 but routed to r0
