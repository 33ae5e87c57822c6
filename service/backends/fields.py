"""The request fields every backend honours, below the services that refuse the others by name
(``service.services.request_fields``): a backend states what it honours
(``Backend.honoured_fields``) as these sets and its own additions."""

from __future__ import annotations

# What the gateway's chat route reads itself, whatever the backend.
CORE_CHAT_FIELDS = frozenset({"model", "messages", "stream", "stream_options"})
# What both backends honour today: the sampling fields every decoder implements.
SAMPLING_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed"})
DEFAULT_HONOURED = CORE_CHAT_FIELDS | SAMPLING_FIELDS
