"""Who holds a message ID, as /trace's registry numbers its holders: an account by its user id, an
account's end user by the negative of its end-user id. One number per holder lets the candidate
sets, the leads of the generation log and the naming rules tell an end user from its account
without a second key; the reports name both (the account as the user, and the end user)."""

from __future__ import annotations


def party_key(user_id: int, end_user_id: int | None = None) -> int:
    """The registry's number of an account (``end_user_id`` None) or of one of its end users."""
    return user_id if end_user_id is None else -end_user_id


def end_user_of(key: int) -> int | None:
    """The end-user id a registry number stands for (None: an account's own number)."""
    return -key if key < 0 else None
