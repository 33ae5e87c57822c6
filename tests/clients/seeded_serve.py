"""`xmark serve` for the client matrix, with the draws that decide the matrix's verdicts seeded.

The matrix's answers are sampled at the clients' default temperature, 1, by the default key
version's distortion-free encoder: an answer is then a fixed function of the key, the caller's
message ID, the answer's salt and the prompt, not of a random generator. The gateway process draws
the message IDs (``allocate_message``) and each user's first salt (``service.salts``) from the
system's randomness; this launcher draws the IDs from a generator seeded here, with the product's
own rule, and each user's first salt from one seeded by the user's ID, then runs the CLI. With the
watermark secret fixed too (tests/clients/conftest.py), a row's answers start the same on every
run (a row's concurrent calls may take its two salts in either order); the last bits of a batch's
logits change with the batch's make-up and flip near-ties, after which an answer goes its own way
(between two runs here, all 13 answers did so part-way, the earliest after 76 characters, about
18 tokens). Unseeded, every answer was a fresh draw from its first token: one ended after 5
tokens, short of MIN_TOKENS, and failed its row in a run of the suite.
"""

from __future__ import annotations

import functools
import random
import sys

import service.salts
import service.services.users
from service.cli import main
from tests.e2e.conftest import MESSAGE_ID_SEED
from xmark_core import allocate_message

SALT_SEED = 20241207


def _seeded_take(self: service.salts.SaltRotation, user_id: int | None, answers: int, salts: int) -> int:
    """``SaltRotation.take`` whose new user starts at a salt seeded by its ID, not at a random one
    (the order in which the rows' first requests arrive varies from run to run)."""
    if salts > 1 and user_id not in self._next:
        self._next[user_id] = random.Random(f"{SALT_SEED}:{user_id}").randrange(salts)
    return _take(self, user_id, answers, salts)


_take = service.salts.SaltRotation.take

if __name__ == "__main__":
    service.services.users.allocate_message = functools.partial(allocate_message, rng=random.Random(MESSAGE_ID_SEED))
    service.salts.SaltRotation.take = _seeded_take  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
