"""The salt rotation of salted distortion-free key versions (service.salts)."""

from __future__ import annotations

import pytest

from service.salts import SaltRotation


def test_a_users_consecutive_answers_take_consecutive_salts() -> None:
    rotation = SaltRotation()
    first = rotation.take(7, 1, 16)
    assert 0 <= first < 16
    # one answer, then a request for three (its answers take first + 2 .. first + 4), then one more
    assert rotation.take(7, 1, 16) == (first + 1) % 16
    assert rotation.take(7, 3, 16) == (first + 2) % 16
    assert rotation.take(7, 1, 16) == (first + 5) % 16
    # so any 16 consecutive answers of a user are under distinct salts
    taken = [rotation.take(7, 1, 16) for _ in range(16)]
    assert sorted(taken) == list(range(16))


def test_users_start_at_random_salts_and_do_not_share_a_rotation() -> None:
    rotation = SaltRotation()
    starts = {rotation.take(user, 1, 256) for user in range(200)}
    assert len(starts) > 100  # 200 draws of 256: about 165 distinct
    before = rotation.take(3, 1, 256)
    rotation.take(4, 5, 256)
    assert rotation.take(3, 1, 256) == (before + 1) % 256


def test_unsalted_versions_take_salt_zero_and_bad_counts_are_refused() -> None:
    rotation = SaltRotation()
    assert rotation.take(1, 4, 1) == 0 and len(rotation) == 0
    with pytest.raises(ValueError, match="answers must be >= 1"):
        rotation.take(1, 0, 16)
    with pytest.raises(ValueError, match="max_users"):
        SaltRotation(0)


def test_it_forgets_the_least_recently_served_user_first() -> None:
    rotation = SaltRotation(max_users=2)
    first = rotation.take(1, 1, 16)
    rotation.take(2, 1, 16)
    rotation.take(1, 1, 16)  # user 1 served again: user 2 is now the oldest
    rotation.take(3, 1, 16)
    assert len(rotation) == 2 and set(rotation._next) == {1, 3}
    assert rotation.take(1, 1, 16) == (first + 2) % 16  # user 1's rotation went on
