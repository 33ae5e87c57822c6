"""Free text that clients send: any Unicode string except one holding unpaired surrogates.

JSON may escape a UTF-16 surrogate on its own (``"a\\ud800b"``); the decoder then yields a Python
string that no UTF-8 encoder accepts, and the tokenizer, the database driver or the response
encoder would fail on it with a 500. A correctly paired escape (``"\\ud83d\\ude00"``) decodes to one
character outside the BMP, so every surrogate code point left in a decoded string is unpaired:
such a string is refused with a 422 that names the field.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_MESSAGE = "must not contain unpaired UTF-16 surrogates (\\ud800-\\udfff)"


def has_lone_surrogate(value: str) -> bool:
    return not value.isascii() and _SURROGATE.search(value) is not None


def reject_lone_surrogates(value: str) -> str:
    """The value unchanged; ValueError when it holds an unpaired surrogate."""
    if has_lone_surrogate(value):
        raise ValueError(SURROGATE_MESSAGE)
    return value


# A string field of a request body; add length or pattern constraints beside it as usual.
Text = Annotated[str, AfterValidator(reject_lone_surrogates)]
