"""An account's end users: the platform's own users, named by the identifier its requests carry
(OpenAI's ``safety_identifier`` or ``user``, Anthropic's ``metadata.user_id``), each watermarked
with message IDs of its own so that /trace names the end user as well as the account.

``identifier``: the request fields' checks; ``repository``: the ``end_users`` queries;
``directory``: the request path (first sight allocates, the cache answers the rest);
``service``: the admin changes; ``schemas`` and ``router``: the admin API.
"""
