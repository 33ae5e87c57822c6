"""`xmark serve` for the client matrix, with the draws that decide the matrix's verdicts fixed.

The matrix's answers are sampled at the clients' default temperature, 1, by the default key
version's distortion-free encoder: an answer is then a fixed function of the key, the caller's
message ID, the answer's salt and the prompt, not of a random generator. The gateway process draws
the message IDs (``allocate_message``) and each user's first salt (``service.salts``) from the
system's randomness; this launcher draws both from generators seeded here, with the product's own
rules, then runs the CLI. With the watermark secret fixed too (tests/clients/conftest.py), every
row's answers are the same on every run, up to the last bits of a batch's logits, which change
with the batch's make-up and rarely flip a choice. Unseeded, one answer in some thousands ended
before MIN_TOKENS (a 5-token answer in a CI run) and failed its row.
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


class _SeededSecrets:
    """The part of ``secrets`` the salt rotation uses, from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def randbelow(self, n: int) -> int:
        return self._rng.randrange(n)


if __name__ == "__main__":
    service.services.users.allocate_message = functools.partial(allocate_message, rng=random.Random(MESSAGE_ID_SEED))
    service.salts.secrets = _SeededSecrets(SALT_SEED)  # type: ignore[assignment]
    sys.exit(main(sys.argv[1:]))
