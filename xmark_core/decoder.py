"""The cTMM decoder (paper, Algorithm 2), vectorised with numpy.

For every scored token t (from the third token of each text on) the k shards of x[t] under the
context (x[t-2], x[t-1]) are computed pointwise (O(k) per token); row i = (x[t-2] + x[t-1]) mod r
of the token-shard mapping matrix gets +1 in every shard the token falls in under some key
(cTMM: at most once per shard, the paper's sign()) or +1 per key (TMM, the paper's XMark^-).
Skipped: the first two tokens of each text, tokens listed in ``skip_ids``, and (``dedup``, on by
default) repeated (x[t-2], x[t-1], x[t]) triples, which would otherwise count the same
pseudo-random draw several times and break the null model that the p-values rely on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import gumbel
from .errors import ArgumentError, ArgumentTypeError, DecodeInputError
from .hashing import block_index, shard
from .keys import WatermarkKey
from .message import Message
from .params import WatermarkParams

MAX_TOKEN_ID = (1 << 31) - 1
TokenIds = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class DecodeResult:
    """What the decoder read from one or more texts.

    matrix: int64 [r, D] the (c)TMM (scheme ``gumbel``: float64 score sums, see ``xmark_core.gumbel``);
    row_counts: int64 [r] scored tokens per block;
    blocks: int64 [r] decoded block values (-1 = erased); erased: bool [r];
    margin: int64 [r] gap between the decisive count and the runner-up in that row;
    confidence: float64 [r] posterior probability of the decoded value of each block;
    token_blocks / token_shards: per input token (concatenated texts) its block index (-1 = not
    scored) and its k shards, only when decoding with per_token=True.
    salt: scheme ``gumbel`` with ``salts`` > 1: the salt read (``gumbel.pick_salt``); ``matrix`` and
    everything read from it are that salt's, and the p-values drawn from it count all S salts.
    """

    params: WatermarkParams
    constrained: bool
    matrix: np.ndarray
    row_counts: np.ndarray
    blocks: np.ndarray
    erased: np.ndarray
    margin: np.ndarray
    confidence: np.ndarray
    scored_tokens: int
    token_blocks: np.ndarray | None = field(default=None, repr=False)
    token_shards: np.ndarray | None = field(default=None, repr=False)
    salt: int = 0

    @property
    def trials(self) -> int:
        """Bernoulli trials behind each cell: one per token (cTMM or k = 1), else one per token and key."""
        return self.scored_tokens * (1 if self.constrained else self.params.num_keys)

    @property
    def bits(self) -> str:
        d = self.params.block_bits
        return "".join("?" * d if v < 0 else format(int(v), f"0{d}b") for v in self.blocks)

    @property
    def message(self) -> Message | None:
        if self.erased.any():
            return None
        return Message(self.bits, self.params)


def null_inclusion_probability(params: WatermarkParams, constrained: bool) -> float:
    """Probability that one trial marks a given cell of its row on unwatermarked text."""
    shards = params.num_shards
    if constrained:
        return 1.0 - (1.0 - 1.0 / shards) ** params.num_keys
    return 1.0 / shards


def _as_texts(token_ids: TokenIds | Sequence[TokenIds]) -> list[np.ndarray]:
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and token_ids.dtype == np.int64:
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > MAX_TOKEN_ID):
            raise DecodeInputError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return [token_ids]
    if isinstance(token_ids, np.ndarray):
        texts = [token_ids] if token_ids.ndim == 1 else list(token_ids)
    elif isinstance(token_ids, (str, bytes)):
        raise ArgumentTypeError("token_ids must be integer token ids, not text")
    else:
        items = list(token_ids)
        nested = [isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, (str, bytes)) for x in items]
        if any(nested) and not all(nested):
            raise ArgumentTypeError("token ids must be a list of ints or a list of lists of ints, not a mix of both")
        try:
            texts = [np.asarray(x) for x in items] if items and all(nested) else [np.asarray(items)]
        except ValueError as exc:
            raise ArgumentTypeError("token ids must be a list of ints or a list of lists of ints") from exc
    out = []
    for text in texts:
        if text.size == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        if text.ndim != 1:
            raise DecodeInputError(f"each text must be a 1-D sequence of token ids (got shape {text.shape})")
        if text.dtype == bool or not np.issubdtype(text.dtype, np.integer):
            raise ArgumentTypeError(f"token ids must be integers (got dtype {text.dtype})")
        if text.min() < 0 or text.max() > MAX_TOKEN_ID:
            raise DecodeInputError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        out.append(text.astype(np.int64, copy=False))
    return out


def decode(
    token_ids: TokenIds | Sequence[TokenIds],
    key: WatermarkKey,
    *,
    skip_ids: Iterable[int] = (),
    dedup: bool = True,
    constrained: bool = True,
    min_observations: int = 1,
    per_token: bool = False,
) -> DecodeResult:
    """Decode the message from the token ids of one text, or of several texts of the same user."""
    params = key.params
    texts = _as_texts(token_ids)
    if not texts or all(t.size < 3 for t in texts):
        raise DecodeInputError("need at least one text of 3 or more tokens to decode (the first two are context)")
    if min_observations < 1:
        raise ArgumentError("min_observations must be >= 1")
    r, shards_n, k = params.num_blocks, params.num_shards, params.num_keys
    scored_texts = [t for t in texts if t.size >= 3]
    if len(scored_texts) == 1:  # the common case: views, no copies
        text = scored_texts[0]
        prev2, prev1, token = text[:-2], text[1:-1], text[2:]
    else:
        prev2 = np.concatenate([t[:-2] for t in scored_texts])
        prev1 = np.concatenate([t[1:-1] for t in scored_texts])
        token = np.concatenate([t[2:] for t in scored_texts])
    top_id = max(int(t.max()) for t in scored_texts)
    keep: np.ndarray | None = None  # bool [n] mask of scored positions (None = all)
    skip = np.fromiter(skip_ids, dtype=np.int64)
    if skip.size:
        keep = ~np.isin(token, skip)
    if dedup:
        order, first = _first_occurrences(prev2, prev1, token, top_id)
        unique = np.zeros(token.size, dtype=bool)
        unique[order[first]] = True
        keep = unique if keep is None else keep & unique
    if keep is None:
        keep = np.ones(token.size, dtype=bool)
        p2, p1, tok = prev2, prev1, token
    else:
        p2, p1, tok = prev2[keep], prev1[keep], token[keep]
    rows = block_index(p2, p1, r)  # [n]
    if params.distortion_free:
        return _decode_gumbel(texts, key, rows, p2, p1, tok, keep, prev2.size, per_token, min_observations)
    shard_ids = shard(key.words, p2, p1, tok, params.block_bits)  # [n, k]
    cells = rows[:, None] * shards_n + shard_ids  # [n, k] flat cell index
    if constrained and k > 1:
        repeated = np.zeros_like(shard_ids, dtype=bool)
        for j in range(1, k):
            repeated[:, j] = (shard_ids[:, j : j + 1] == shard_ids[:, :j]).any(axis=1)
        counted = cells[~repeated]
    else:
        counted = cells.ravel()
    matrix = np.bincount(counted, minlength=r * shards_n).reshape(r, shards_n)
    row_counts = np.bincount(rows, minlength=r)
    blocks, erased, margin, confidence = _read_blocks(matrix, row_counts, params, constrained, min_observations)
    token_blocks = token_shards = None
    if per_token:
        token_blocks = np.full(prev2.size, -1, dtype=np.int64)
        token_blocks[keep] = rows
        token_shards = np.full((prev2.size, k), -1, dtype=np.int64)
        token_shards[keep] = shard_ids
        # re-align to the input: two unscored context tokens at the start of every text
        token_blocks, token_shards = _align(texts, token_blocks, token_shards, k)
    return DecodeResult(
        params=params,
        constrained=constrained,
        matrix=matrix,
        row_counts=row_counts,
        blocks=blocks,
        erased=erased,
        margin=margin,
        confidence=confidence,
        scored_tokens=int(rows.size),
        token_blocks=token_blocks,
        token_shards=token_shards,
    )


def _decode_gumbel(
    texts: list[np.ndarray],
    key: WatermarkKey,
    rows: np.ndarray,
    p2: np.ndarray,
    p1: np.ndarray,
    tok: np.ndarray,
    keep: np.ndarray,
    positions: int,
    per_token: bool,
    min_observations: int,
) -> DecodeResult:
    """The ``gumbel`` scheme's matrix: cell [i, v] sums -log(1 - u) of block i's tokens under value v
    (float64; see ``xmark_core.gumbel``). ``token_shards`` holds each token's best value."""
    params = key.params
    r, values = params.num_blocks, params.num_shards
    scores = gumbel.token_scores(key.words, p2, p1, tok, params.num_values)  # [n, D * S]
    matrix = np.zeros((r, params.num_values), dtype=np.float64)
    np.add.at(matrix, rows, scores)
    row_counts = np.bincount(rows, minlength=r)
    salt = gumbel.pick_salt(matrix, row_counts, params.salts)
    if params.salts > 1:
        matrix = np.ascontiguousarray(matrix[:, salt * values : (salt + 1) * values])  # [r, D]
        scores = scores[:, salt * values : (salt + 1) * values]
    blocks, erased, margin, confidence = _read_gumbel_blocks(matrix, row_counts, min_observations)
    token_blocks = token_shards = None
    if per_token:
        token_blocks = np.full(positions, -1, dtype=np.int64)
        token_blocks[keep] = rows
        token_shards = np.full((positions, 1), -1, dtype=np.int64)
        token_shards[keep, 0] = scores.argmax(axis=1)
        token_blocks, token_shards = _align(texts, token_blocks, token_shards, 1)
    return DecodeResult(
        params=params,
        constrained=True,
        matrix=matrix,
        row_counts=row_counts,
        blocks=blocks,
        erased=erased,
        margin=margin,
        confidence=confidence,
        scored_tokens=int(rows.size),
        token_blocks=token_blocks,
        token_shards=token_shards,
        salt=salt,
    )


def _read_gumbel_blocks(
    matrix: np.ndarray, row_counts: np.ndarray, min_observations: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Block values (the largest score), erasures, margins (score units) and per-block posteriors
    under an Exp(rate) model of the message cell's scores against Exp(1) elsewhere, the rate fitted
    to the decoded cells."""
    blocks = matrix.argmax(axis=1)
    ordered = np.sort(matrix, axis=1)
    top = ordered[:, -1]
    margin = top - ordered[:, -2]
    erased = row_counts < min_observations
    tokens = int(row_counts[~erased].sum())
    decisive = float(top[~erased].sum())
    weight = 1.0 - tokens / decisive if tokens > 0 and decisive > tokens else 0.0  # 1 - fitted rate
    confidence = 1.0 / np.exp(weight * (matrix - top[:, None])).sum(axis=1)
    blocks[erased] = -1
    confidence[erased] = 0.0
    return blocks, erased, margin, confidence


def _first_occurrences(
    prev2: np.ndarray, prev1: np.ndarray, token: np.ndarray, top_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort order of the (x[t-2], x[t-1], x[t]) triples and a mask of each triple's first
    occurrence in that order. top_id: the largest id in the texts."""
    first = np.empty(token.size, dtype=bool)
    first[:1] = True
    if top_id < (1 << 21):
        keys = (prev2 << 42) | (prev1 << 21) | token  # one exact int64 key per triple
        order = np.argsort(keys, kind="stable")  # equal triples keep their text order
        ordered = keys[order]
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        return order, first
    order = np.lexsort((token, prev1, prev2))  # stable: ties keep their text order
    first[1:] = (np.diff(prev2[order]) != 0) | (np.diff(prev1[order]) != 0) | (np.diff(token[order]) != 0)
    return order, first


def _align(texts: list[np.ndarray], blocks: np.ndarray, shards: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    out_b, out_s, start = [], [], 0
    for text in texts:
        n = text.size
        out_b.append(np.full(min(n, 2), -1, dtype=np.int64))
        out_s.append(np.full((min(n, 2), k), -1, dtype=np.int64))
        if n >= 3:
            out_b.append(blocks[start : start + n - 2])
            out_s.append(shards[start : start + n - 2])
            start += n - 2
    return np.concatenate(out_b), np.concatenate(out_s)


def _read_blocks(
    matrix: np.ndarray,
    row_counts: np.ndarray,
    params: WatermarkParams,
    constrained: bool,
    min_observations: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Block values (argmin, or argmax for MPAC), erasures, margins and per-block posteriors."""
    boosted_is_max = params.scheme == "mpac"
    signed = matrix if boosted_is_max else -matrix  # [r, D], larger = more likely the message value
    ordered = np.sort(signed, axis=1)
    top = ordered[:, -1]
    margin = top - ordered[:, -2]
    blocks = signed.argmax(axis=1)
    erased = row_counts < min_observations
    # posterior of each value under a per-trial rate q1 for the message cell against q0 elsewhere,
    # with q1 estimated from the decoded cells (no evidence -> uniform)
    trials = int(row_counts.sum()) * (1 if constrained else params.num_keys)
    q0 = null_inclusion_probability(params, constrained)
    decisive = abs(int(top[~erased].sum()))
    lam = 0.0
    if trials > 0:
        q1 = min(max(decisive / trials, 1e-6), 1 - 1e-6)
        if (q1 > q0) == boosted_is_max and q1 != q0:
            lam = abs(float(np.log(q1 * (1 - q0) / (q0 * (1 - q1)))))
    # posterior of the decoded value = 1 / sum_u exp(lam * (signed_u - top))
    confidence = 1.0 / np.exp(lam * (signed - top[:, None])).sum(axis=1)
    blocks[erased] = -1
    confidence[erased] = 0.0
    return blocks, erased, margin, confidence
