"""Keyed content sketches: what the generation log keeps of a completion's text, and what a suspect
text is compared with. Pure computation, no I/O.

A sketch supports similarity search without revealing the text:

* ``terms``: keyed hashes of the text's normalised content words (casefolded, NFKC, stop words
  dropped, a light suffix stripping so that "printing" and "printed" meet), for paraphrase-robust
  search: a rewrite keeps most of the topic words while changing the wording. A completion keeps
  at most ``TERM_LIMIT`` of them, chosen by hash (a bottom-k sample, the same for every text, so
  two texts' samples agree on the words they share); a suspect text keeps up to
  ``QUERY_TERM_LIMIT``.
* ``minhash``: a MinHash signature of the text's word 3-gram shingles (``MINHASH_SIZE`` values),
  for near-duplicate comparison: the share of equal positions estimates the shingles' Jaccard
  similarity. The positions' seeds are a fixed sequence, so a signature's first values are those
  of any shorter signature of the same text: sketches logged with ``LEGACY_MINHASH_SIZE``
  positions are compared on those positions.

Every hash is keyed with a key derived (HKDF, a label of its own) from a server secret, so the
stored integers cannot be turned back into words by hashing a dictionary. Scripts without spaces
between words (CJK) are read as character bigrams; symbols and emoji are not words. A text with
no word gives no sketch (``None``); the size of a sketch is bounded whatever the text's size.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

logger = logging.getLogger("xmark.provenance")

SKETCH_KEY_LABEL = b"xmark-gateway provenance sketch key v1"
TERM_LIMIT = 128  # content-word hashes kept per logged completion
QUERY_TERM_LIMIT = 1024  # per suspect text
# 128 positions: a copy with a fifth of its tokens replaced (3-gram Jaccard about 0.3) is told from
# another answer to the same prompt (about 0.05) with a standard error of 0.04 instead of 0.08.
MINHASH_SIZE = 128
LEGACY_MINHASH_SIZE = 32  # the signature length of sketches logged before
SHINGLE_WORDS = 3
# A suspect text is also read in parts (``text_parts``): at most this many, of at least this many
# content words each, so that a completion pasted between other paragraphs is searched by its own
# words, not only by the rarest words of the text around it.
MAX_PARTS = 4
MIN_PART_WORDS = 16  # as many as a logged completion needs for its containment to count (retrieval)
# Only this many characters of a text are read (a completion is bounded by its token cap anyway;
# a suspect text by XMARK_MAX_TRACE_CHARS): the sketch's cost stays bounded.
MAX_CHARS = 200_000
TERM_MASK = 0x7FFFFFFF  # terms are positive 31-bit integers (int4 in the database)

_WORD = re.compile(r"\w+")
# Han, Hiragana, Katakana, Hangul: runs of these are read as character bigrams
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")

# English function words: frequent everywhere, so they say nothing about a text's source
_STOP_WORDS_TEXT = """a about above after again against all also am an and any are as at be because been before
    being below
    between both but by can could did do does doing down during each few for from further had has have having he
    her here hers herself him himself his how i if in into is it its itself just let me more most my myself no
    nor not now of off on once only or other our ours ourselves out over own same she should so some such than
    that the their theirs them themselves then there these they this those through to too under until up upon
    us very was we were what when where which while who whom why will with would you your yours yourself
    yourselves one two may might must shall within without via per etc yes okay ok like well get got make made
    many much every another however therefore thus"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())
_SUFFIXES = ("ations", "ation", "ingly", "ings", "ing", "edly", "ies", "ied", "ed", "es", "ly", "s")


def derive_sketch_key(secret: bytes) -> bytes:
    """The 32-byte sketch key derived from a server secret (HKDF-SHA256 under its own label)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SKETCH_KEY_LABEL).derive(secret)


def words(text: str) -> list[str]:
    """The text's words: NFKC, casefolded; CJK runs as character bigrams (a lone character alone)."""
    out: list[str] = []
    for word in _WORD.findall(unicodedata.normalize("NFKC", text[:MAX_CHARS]).casefold()):
        if not _CJK.search(word):
            out.append(word)
            continue
        for part in re.split(f"({_CJK.pattern})", word):
            if not part:
                continue
            if _CJK.fullmatch(part):
                out.extend([part] if len(part) == 1 else [part[i : i + 2] for i in range(len(part) - 1)])
            else:
                out.append(part)
    return out


_SUFFIX = re.compile(f"^(.{{3,}}?)(?:{'|'.join(_SUFFIXES)})$")


def stem(word: str) -> str:
    """A light suffix stripping for Latin-script words (a rewrite changes inflections): the
    longest of ``_SUFFIXES`` that leaves at least three letters."""
    if len(word) <= 4 or not word.isascii():
        return word
    match = _SUFFIX.match(word)
    return word if match is None else match.group(1)


def content_words(tokens: Iterable[str]) -> set[str]:
    """The distinct stemmed content words: no stop word, no one- or two-letter Latin word, no number."""
    out = set()
    for word in dict.fromkeys(tokens):
        if word in STOP_WORDS or word.isdigit() or (word.isascii() and len(word) < 3):
            continue
        out.add(stem(word))
    return out


@dataclass(frozen=True)
class Sketch:
    """``terms``: sorted distinct positive 31-bit term hashes; ``minhash``: ``MINHASH_SIZE`` values
    (empty when the text has no shingle); ``parts``: a suspect text's terms by part (``text_parts``),
    for a search that gives each part a say; empty for a logged completion and a one-part text."""

    terms: tuple[int, ...]
    minhash: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...] = ()

    @property
    def size_bytes(self) -> int:
        """What the sketch stores: 4 bytes per value."""
        return 4 * (len(self.terms) + len(self.minhash))


class Sketcher:
    """Sketches texts under one key (``derive_sketch_key``)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the sketch key must have at least 16 bytes")
        self._key = key[:64]
        seeds = b"".join(
            hashlib.blake2b(b"minhash seeds %d" % i, key=self._key, digest_size=64).digest()
            for i in range(-(-8 * MINHASH_SIZE // 64))
        )
        self._seeds = np.frombuffer(seeds[: 8 * MINHASH_SIZE], dtype="<u8").copy()  # [MINHASH_SIZE]

    def __repr__(self) -> str:
        return "Sketcher(key=<hidden>)"

    def _hash64(self, item: str) -> int:
        digest = hashlib.blake2b(item.encode("utf-8", "surrogatepass"), key=self._key, digest_size=8)
        return int.from_bytes(digest.digest(), "little")

    def term(self, word: str) -> int:
        """The keyed hash of a (normalised) content word: a positive 31-bit integer."""
        return (self._hash64(word) & TERM_MASK) or 1

    def terms(
        self, tokens: Iterable[str], limit: int = TERM_LIMIT, hashes: dict[str, int] | None = None
    ) -> tuple[int, ...]:
        """The content-word hashes of a text's ``words``, sorted; the ``limit`` smallest (a
        bottom-k sample). ``hashes``: words already hashed (their 64-bit keyed hashes)."""
        known = hashes or {}
        hashed = sorted({(known.get(w) or self._hash64(w)) & TERM_MASK or 1 for w in content_words(tokens)})
        return tuple(hashed[:limit])

    def minhash(self, tokens: Sequence[str], hashes: dict[str, int] | None = None) -> tuple[int, ...]:
        """MinHash of the word 3-gram shingles (a shorter text is one shingle); 31-bit values.

        Each distinct word is hashed once (keyed); a shingle's hash mixes its words' hashes by
        position, so the cost is one keyed hash per distinct word and vector arithmetic.
        ``hashes``: the words' keyed hashes, when already computed."""
        if not tokens:
            return ()
        distinct = hashes if hashes is not None else {w: self._hash64(w) for w in dict.fromkeys(tokens)}
        hashed = np.fromiter((distinct[w] for w in tokens), dtype=np.uint64, count=len(tokens))  # [W]
        n = SHINGLE_WORDS
        if len(tokens) < n:
            hashed = np.concatenate([hashed, np.zeros(n - len(tokens), dtype=np.uint64)])  # one shingle
        width = len(hashed) - n + 1
        shingles = hashed[:width]  # [S]; array arithmetic wraps (no overflow warning, unlike scalars)
        for offset in range(1, n):
            shingles = _mix64(shingles * _GOLDEN + hashed[offset : offset + width])  # a fresh array
        shingles = np.unique(shingles)  # a repeated shingle counts once
        mixed = _mix64(shingles[:, None] ^ self._seeds[None, :])  # [S, MINHASH_SIZE], a fresh array
        return tuple((mixed.min(axis=0) >> _SHIFT33).tolist())

    def sketch(self, text: str, *, limit: int = TERM_LIMIT, parts: bool = False) -> Sketch | None:
        """The sketch of ``text``; ``None`` when it has no word (an empty text, only symbols).
        ``parts``: also the terms of each of the text's parts (``text_parts``; a suspect text)."""
        tokens = words(text)
        if not tokens:
            return None
        hashes = {w: self._hash64(w) for w in dict.fromkeys(tokens)}  # one keyed hash per distinct word
        terms = self.terms(tokens, limit, hashes)
        by_part: tuple[tuple[int, ...], ...] = ()
        if parts:
            kept = set(terms)  # a part's terms within the text's own sample (the terms a search has figures for)
            by_part = tuple(tuple(t for t in self.terms(part, limit, hashes) if t in kept) for part in text_parts(text))
        return Sketch(terms, self.minhash(tokens, hashes), by_part)


def text_parts(text: str) -> list[list[str]]:
    """A suspect text's parts, as word lists: its lines (paragraphs, list items) grouped in order
    into runs of at least ``MIN_PART_WORDS`` content words (a shorter last run joins the one before),
    then the two neighbouring runs with the fewest content words merged until at most ``MAX_PARTS``
    are left. A text pasted into other writing keeps its own lines, so one part holds mostly its
    words. A text of fewer than two runs is one part: an empty list."""
    runs: list[tuple[list[str], int]] = []
    current: list[str] = []
    size = 0
    for line in text[:MAX_CHARS].splitlines():
        tokens = words(line)
        current.extend(tokens)
        size += len(content_words(tokens))
        if size >= MIN_PART_WORDS:
            runs.append((current, size))
            current, size = [], 0
    if current and runs:
        last, n = runs[-1]
        runs[-1] = (last + current, n + size)  # too few content words for a part: with the run before
    while len(runs) > MAX_PARTS:
        i = min(range(len(runs) - 1), key=lambda j: runs[j][1] + runs[j + 1][1])
        runs[i : i + 2] = [(runs[i][0] + runs[i + 1][0], runs[i][1] + runs[i + 1][1])]
    return [run for run, _ in runs] if len(runs) >= 2 else []


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SHIFT27, _SHIFT30, _SHIFT31, _SHIFT33 = (np.uint64(s) for s in (27, 30, 31, 33))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a keyed permutation per seed.
    Arrays only: numpy wraps array arithmetic silently (scalars would warn on overflow). Works in
    place: ``x`` (a fresh array of the caller's) is overwritten and returned, which saves most of
    the cost of the [shingles x positions] matrix."""
    shifted = x >> _SHIFT30
    x ^= shifted
    x *= _MIX1
    np.right_shift(x, _SHIFT27, out=shifted)
    x ^= shifted
    x *= _MIX2
    np.right_shift(x, _SHIFT31, out=shifted)
    x ^= shifted
    return x


def minhash_similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """The share of equal MinHash positions: an estimate of the shingles' Jaccard similarity. Two
    signatures of different lengths (one logged with ``LEGACY_MINHASH_SIZE`` positions) are
    compared on the positions both have."""
    n = min(len(a), len(b))
    if n == 0:
        return 0.0
    return sum(x == y for x, y in zip(a[:n], b[:n], strict=True)) / n


def sketch_columns(sketcher: Sketcher | None, text: str) -> dict[str, Any]:
    """The sketch columns of a generation record (None when provenance is off or the text has no
    word). Never raises: a text the sketcher cannot read costs the record nothing but its sketch."""
    if sketcher is None:
        return {"sketch_terms": None, "sketch_minhash": None}
    try:
        sketch = sketcher.sketch(text)
    except Exception as exc:  # a sketch is never worth a record
        logger.warning("completion not sketched", extra={"error_type": type(exc).__name__})
        sketch = None
    if sketch is None:
        return {"sketch_terms": None, "sketch_minhash": None}
    return {"sketch_terms": list(sketch.terms), "sketch_minhash": list(sketch.minhash)}
