"""Watermark parameters: one frozen, validated object shared by encoder and decoder."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from .errors import ArgumentTypeError, ParamsError

Scheme = Literal["xmark", "mpac", "loso", "gumbel"]
SCHEMES: tuple[str, ...] = ("xmark", "mpac", "loso", "gumbel")
# the schemes that bias logits (``gumbel`` samples instead: see ``xmark_core.gumbel``)
BIASING_SCHEMES: tuple[str, ...] = ("xmark", "mpac", "loso")
MAX_BITS = 256
# d for the biasing schemes: each key partitions the vocabulary into 2**d shards
MAX_BLOCK_BITS = 4
# d for ``gumbel``: a block value only enters the keyed hash, so a block can carry more bits; the
# decoders hold a [tokens, 2**d] score table per text, which bounds it
MAX_GUMBEL_BLOCK_BITS = 8
# S for ``gumbel``: per-answer salts a key version draws from (the decoders try each, Bonferroni x S)
MAX_SALTS = 256


# The scheme of new key versions when none is configured (the gateway's and the vLLM workers' default
# alike): distortion-free keyed sampling in 8-bit blocks with 16 salts, chosen from the frontier of
# naming against answer quality (docs/results/QUALITY.md); ``xmark`` is the biasing scheme of the paper.
DEFAULT_SCHEME: Scheme = "gumbel"


def default_salts(scheme: str) -> int:
    """The salts of a new key version of ``scheme`` when none are configured (the gateway's and the
    vLLM workers' default alike): 16 for ``gumbel``, 1 (none) for the biasing schemes."""
    return 16 if scheme == "gumbel" else 1


def default_block_bits(scheme: str) -> int:
    """Bits per block of a new key version of ``scheme`` when none are configured: 8 for ``gumbel``
    (an author's nearest registered ID then differs in most of the text), 2 for the biasing schemes."""
    return 8 if scheme == "gumbel" else 2


def default_num_keys(scheme: str) -> int:
    """Keys of a new key version of ``scheme`` when none are configured: 1 for ``gumbel`` (the only
    value it takes), 4 for the biasing schemes (docs/results/FORENSIC.md)."""
    return 1 if scheme == "gumbel" else 4


# the largest min-entropy threshold (nats): the min-entropy of a 49,152-token vocabulary is at most 10.8
MAX_MIN_ENTROPY = 16.0


@dataclass(frozen=True, slots=True)
class WatermarkParams:
    """Parameters of a multi-bit watermark.

    bits (b): message length in bits, a positive multiple of ``block_bits``.
    block_bits (d): bits per message block: 1..4 for the biasing schemes (each key partitions the
        vocabulary into 2**d shards), 1..8 for ``gumbel`` (the block value enters the keyed hash). Two
        users' IDs can be told apart only by the blocks where they differ: with larger blocks, IDs
        drawn far apart differ in more of the text's tokens (docs/results/FORENSIC-GUMBEL8.md).
    num_keys (k): number of hash keys (1..8). ``loso``, ``mpac`` and ``gumbel`` use exactly one key.
    delta: logit bias added to the boosted tokens (> 0); ``gumbel`` adds none and requires the
        default (2.0), so that one setting has one fingerprint.
    scheme: ``xmark`` (evergreen list = intersection of the k leave-one-shard-out green lists),
        ``loso`` (XMark with k = 1), ``mpac`` (green list = the shard numbered by the block value) or
        ``gumbel`` (distortion-free: keyed Gumbel-max sampling, see ``xmark_core.gumbel``).
    min_entropy: the entropy rule (nats). A position is biased only where the model's min-entropy
        there, -log of its top token's probability at temperature 1 before the bias, is at least
        this; 0 (the default) biases every position. The rule depends on the model's distribution
        alone (never on the key), so the counting decoder stays calibrated with it on, and the
        likelihood decoder, which has the distribution, leaves the positions the rule skips out.
        Part of the key version (its fingerprint covers it when it is not 0).
    salts: ``gumbel`` only, S: the number of salts an answer's keyed sampling draws from (1..256;
        1, the default, is no salt). Under one key, a user's answer is a fixed function of the
        prompt, the user and the contexts it passes through; a salt s enters the keyed hash with
        every block value (value v + s * 2**d), so answers written under different salts are
        sampled independently. The gateway gives a user's consecutive answers consecutive salts
        (mod S); the decoders try every salt and pay for it in their p-values (Bonferroni x S). Part
        of the key version (its fingerprint covers it when it is not 1).
    """

    bits: int = 16
    block_bits: int = 2
    num_keys: int = 2
    delta: float = 2.0
    scheme: Scheme = "xmark"
    min_entropy: float = 0.0
    salts: int = 1

    def __post_init__(self) -> None:
        _check_int("block_bits", self.block_bits, 1, MAX_GUMBEL_BLOCK_BITS)
        _check_int("bits", self.bits, self.block_bits, MAX_BITS)
        if self.bits % self.block_bits:
            raise ParamsError(
                f"bits must be a positive multiple of block_bits={self.block_bits} (got bits={self.bits})"
            )
        _check_int("num_keys", self.num_keys, 1, 8)
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)):
            raise ArgumentTypeError(f"delta must be a number > 0 (got {type(self.delta).__name__})")
        if not (self.delta > 0.0) or self.delta != self.delta or self.delta == float("inf"):
            raise ParamsError(f"delta must be a finite number > 0 (got {self.delta})")
        object.__setattr__(self, "delta", float(self.delta))  # 2 and 2.0 are the same key version
        if isinstance(self.min_entropy, bool) or not isinstance(self.min_entropy, (int, float)):
            kind = type(self.min_entropy).__name__
            raise ArgumentTypeError(f"min_entropy must be a number in [0, {MAX_MIN_ENTROPY:g}] (got {kind})")
        if not 0.0 <= self.min_entropy <= MAX_MIN_ENTROPY:  # NaN fails both
            raise ParamsError(f"min_entropy must be in [0, {MAX_MIN_ENTROPY:g}] nats (got {self.min_entropy})")
        object.__setattr__(self, "min_entropy", float(self.min_entropy))
        if self.scheme not in SCHEMES:
            raise ParamsError(f"scheme must be one of {', '.join(SCHEMES)} (got {self.scheme!r})")
        if self.scheme != "gumbel" and self.block_bits > MAX_BLOCK_BITS:
            raise ParamsError(
                f"block_bits must be in [1, {MAX_BLOCK_BITS}] for scheme {self.scheme!r} (got {self.block_bits}); "
                f"scheme 'gumbel' allows up to {MAX_GUMBEL_BLOCK_BITS}"
            )
        _check_int("salts", self.salts, 1, MAX_SALTS)
        if self.salts != 1 and self.scheme != "gumbel":
            raise ParamsError(f"salts applies to scheme 'gumbel' only (got salts={self.salts} for {self.scheme!r})")
        if self.scheme in ("loso", "mpac", "gumbel") and self.num_keys != 1:
            raise ParamsError(f"num_keys must be 1 for scheme {self.scheme!r} (got {self.num_keys})")
        if self.scheme == "gumbel":
            if self.delta != 2.0:
                raise ParamsError(f"scheme 'gumbel' adds no bias: delta must be left at 2.0 (got {self.delta})")
            if self.gated:
                raise ParamsError(
                    "scheme 'gumbel' changes no distribution: the entropy rule (min_entropy) does not apply"
                )

    @property
    def num_blocks(self) -> int:
        """r = b / d, the number of message blocks."""
        return self.bits // self.block_bits

    @property
    def num_shards(self) -> int:
        """D = 2**d, the number of shards each key partitions the vocabulary into."""
        return 1 << self.block_bits

    @property
    def distortion_free(self) -> bool:
        """Whether the scheme samples (``gumbel``) instead of biasing logits."""
        return self.scheme == "gumbel"

    @property
    def num_values(self) -> int:
        """D * S: the values the keyed hash of a ``gumbel`` key sees (block value v under salt s is
        v + s * D); D for every other scheme."""
        return self.num_shards * self.salts

    @property
    def gated(self) -> bool:
        """Whether the entropy rule is on (some positions may go unbiased)."""
        return self.min_entropy > 0.0

    def to_dict(self) -> dict[str, Any]:
        """The parameters as JSON-able values. ``min_entropy`` appears only when the rule is on and
        ``salts`` only when above 1, so the fingerprint of every key version made before they
        existed is unchanged."""
        out = asdict(self)
        if not self.gated:
            del out["min_entropy"]
        if self.salts == 1:
            del out["salts"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WatermarkParams:
        return cls(
            bits=int(data["bits"]),
            block_bits=int(data["block_bits"]),
            num_keys=int(data["num_keys"]),
            delta=float(data["delta"]),
            scheme=data.get("scheme", "xmark"),
            min_entropy=float(data.get("min_entropy", 0.0)),
            salts=int(data.get("salts", 1)),
        )


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an integer in [{low}, {high}] (got {type(value).__name__})")
    if not low <= value <= high:
        raise ParamsError(f"{name} must be in [{low}, {high}] (got {value})")
