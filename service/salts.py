"""Which salt each answer of a salted distortion-free key version is written under.

Under a ``gumbel`` key version an answer is a fixed function of the user, the prompt and the contexts
it passes through (``xmark_core.gumbel``): without salts, a user asking the same question twice would
get the same answer. A key version with S salts (``WatermarkParams.salts``) writes each answer under
one of them; this rotation gives a user's consecutive answers consecutive salts (mod S), starting at
a random one, so any S consecutive answers of a user (the n answers of one request included) are
written under distinct salts and sampled independently. Answers S apart share a salt again: asked
the same prompt, they are alike as unsalted answers are (docs/service.md, "The distortion-free
scheme"). The rotation lives in the process: with several gateway processes, a user's requests that
land on different processes draw their salts independently (two coincide with probability 1/S).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

# users whose next salt is remembered; the least recently served is forgotten first (its next answer
# then starts at a random salt, as a new user's does)
MAX_USERS = 65_536


class SaltRotation:
    """Each user's next salt, for the process's lifetime (bounded: least recently served forgotten)."""

    def __init__(self, max_users: int = MAX_USERS) -> None:
        if max_users < 1:
            raise ValueError("max_users must be >= 1")
        self._max_users = max_users
        self._next: OrderedDict[int | None, int] = OrderedDict()

    def take(self, user_id: int | None, answers: int, salts: int) -> int:
        """The salt of this request's first answer (its answer j takes salt + j, mod ``salts``);
        reserves ``answers`` salts for the user. 0 when ``salts`` is 1 (an unsalted key version)."""
        if answers < 1:
            raise ValueError("answers must be >= 1")
        if salts <= 1:
            return 0
        start = self._next.pop(user_id, None)
        first = secrets.randbelow(salts) if start is None else start % salts
        self._next[user_id] = (first + answers) % salts
        while len(self._next) > self._max_users:
            self._next.popitem(last=False)
        return first

    def __len__(self) -> int:
        return len(self._next)


def seeded_salt(seed: int, salts: int) -> int:
    """The salt of the first answer of a request that carries ``seed``: a function of the seed
    alone, so the same request with the same seed from the same user is written under the same salt
    and, its sampling seeded too, gives the same answer (OpenAI's best-effort determinism). The
    user's rotation is left as it was. 0 when ``salts`` is 1."""
    return seed % salts if salts > 1 else 0
