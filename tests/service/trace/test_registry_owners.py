"""``Owners``: who holds each registered ID, packed in arrays (``service.services.registry_cache``),
answers as the mapping of ``RegisteredUser`` it replaces did, through a load in slices, a refresh
that adds end users and renames an account, and a snapshot restricted to a few holders."""

from __future__ import annotations

import random

import pytest

from service.repositories.registry import RegistryEntry
from service.services.registry_cache import Owners, RegisteredUser, SnapshotBuilder, build_snapshot
from xmark_core import WatermarkParams

PARAMS = WatermarkParams(bits=32, block_bits=2)


def _entries(rng: random.Random, accounts: range, end_users: int, first_end_user: int) -> list[RegistryEntry]:
    found = []
    end_user_id = first_end_user
    for account in accounts:
        found.append(RegistryEntry(account, f"acct-{account}", "active", format(rng.getrandbits(32), "032b")))
        for _ in range(end_users):
            found.append(
                RegistryEntry(
                    account,
                    f"acct-{account}",
                    "active",
                    format(rng.getrandbits(32), "032b"),
                    end_user_id,
                    f"eu-{end_user_id}-é",  # not ASCII: stored as UTF-8
                )
            )
            end_user_id += rng.choice((1, 7))  # ids with gaps
    rng.shuffle(found)  # the load's order is the allocation order, not the ids'
    return found


def _expected(entries: list[RegistryEntry]) -> dict[int, RegisteredUser]:
    return {e.key: RegisteredUser(e.user_id, e.name, e.status, e.end_user_id, e.identifier) for e in entries}


def test_owners_loaded_in_slices_answer_as_the_mapping_they_replace() -> None:
    rng = random.Random(7)
    entries = _entries(rng, range(1, 21), 50, 1000)
    builder = SnapshotBuilder(PARAMS)
    for start in range(0, len(entries), 97):  # slices of a load
        builder.add(entries[start : start + 97])
    snapshot = builder.finish()
    expected = _expected(entries)
    assert isinstance(snapshot.users, Owners)
    assert len(snapshot) == len(entries) == len(snapshot.users)
    assert dict(snapshot.users.items()) == expected
    assert snapshot.users == expected  # as a Mapping
    assert snapshot.users.get(-1) is None and snapshot.users.get(999) is None and 999 not in snapshot.users
    with pytest.raises(KeyError):
        snapshot.users[-999_999]
    # the same as one slice
    assert build_snapshot(entries, PARAMS).users == expected


def test_a_refresh_adds_end_users_and_renames_an_account_with_its_end_users() -> None:
    rng = random.Random(8)
    owners = Owners.of(_entries(rng, range(1, 4), 5, 1))
    owners.REPACK_AT = 4  # type: ignore[misc]  # pack while adding, as a large refresh does
    added = _entries(rng, range(4, 6), 3, 10_000)
    owners.add(added)
    owners.add(added[:3])  # read again (the refresh's window behind the newest row): no change
    for entry in added:
        assert owners[entry.key] == RegisteredUser(
            entry.user_id, entry.name, entry.status, entry.end_user_id, entry.identifier
        )
    assert len(owners) == 3 * 6 + len(added)
    owners.update_account(2, "renamed", "disabled")
    owners.update_account(99, "never-seen", "active")  # not registered: nothing to rename
    renamed = [owners[key] for key in owners if owners[key].user_id == 2]
    assert len(renamed) == 6 and all((u.name, u.status) == ("renamed", "disabled") for u in renamed)
    assert 99 not in owners


def test_a_restricted_snapshot_keeps_the_chosen_holders_in_their_order() -> None:
    rng = random.Random(9)
    entries = _entries(rng, range(1, 6), 10, 1)
    snapshot = build_snapshot(entries, PARAMS)
    # unknown holders below, between and above every registered one are left out
    chosen = [-(10**12), entries[5].key, entries[0].key, 123_456, entries[5].key, 10**12]
    restricted = snapshot.restricted(chosen)
    assert list(restricted.candidates.ids) == [entries[5].key, entries[0].key]
    assert restricted.users == {k: snapshot.users[k] for k in (entries[5].key, entries[0].key)}
