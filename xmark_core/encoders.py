"""One key version, two encoders: distortion-free keyed sampling where a request leaves the model a
choice, the paper's XMark bias everywhere else.

A distortion-free watermark (``gumbel``) writes its message into the sampling draw, so it cannot
live in a distribution with no entropy: a greedy request, a temperature of 0.2, or a sampler that
applies penalties or ``logit_bias`` after the keyed choice would leave the text unmarked. A key
version of the configured scheme ``auto`` (``PER_REQUEST``, the default) therefore carries two
encoders under its one secret:

* the *primary*, a ``gumbel`` parameter set (distortion-free, salted, 8-bit blocks), and
* the *companion*, a biasing (``xmark``) parameter set of the same message length in bits, whose
  hash keys derive from the secret under a label of their own (``companion_key``), so the two
  encoders' keys are independent.

The gateway chooses one of them per request (``service.services.encoder_choice``); each is an
ordinary :class:`~xmark_core.params.WatermarkParams` with its own key and fingerprint, so every
encoder, decoder and test of the library serves either unchanged, and ``/trace`` reads a text
under both, counting each as one more test. Each encoder's message length (bits, block_bits) holds
its own message ID per user, as every length does.

A key version of a single scheme (``gumbel``, ``xmark``, ``loso``, ``mpac``) has no companion:
every request is encoded by its primary, as before the companion existed.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final, Literal

from .errors import ParamsError
from .keys import WatermarkKey
from .params import SCHEMES, Scheme, WatermarkParams, default_block_bits, default_num_keys

# the configured scheme whose key versions carry both encoders, one chosen per request
PER_REQUEST: Final = "auto"
ConfiguredScheme = Literal["auto", "xmark", "mpac", "loso", "gumbel"]
CONFIGURED_SCHEMES: tuple[str, ...] = (PER_REQUEST, *SCHEMES)
# the scheme of each part of a per-request key version
PRIMARY_SCHEME: Final[Scheme] = "gumbel"
COMPANION_SCHEME: Final[Scheme] = "xmark"
# the configured scheme of new key versions when none is set, the gateway's and the vLLM workers' alike
DEFAULT_CONFIGURED_SCHEME: Final[ConfiguredScheme] = PER_REQUEST
# the message-ID length of new key versions when none is set, the gateway's and the vLLM workers'
# alike: among 10^7 registered IDs (10^4 platform accounts x 10^3 end users) 64 bits name 98 % of
# 150-token answers found in the generation log where 32 bits name 95 %, and never wrongly where 32
# bits did (docs/results/REGISTRY-SCALE.md); TEMPERATURE-B64.md measures the rule's other cells at 64
# bits. ``spec_for`` without ``bits`` keeps 32, the length the evaluations' presets were measured at.
DEFAULT_MESSAGE_BITS: Final = 64
# the companion's bias when none is configured: the smallest point of its frontier (naming against
# perplexity at temperatures 0-0.5 and under a logit_bias list) that names 150-token texts among 10^4
# users >= 95 % in every cell the rule sends it (docs/results/TEMPERATURE.md; at δ = 2 and 3 in
# COMPANION-D3.md and COMPANION-D4.md's comparison, δ = 3 misses under logit_bias); a single biasing
# scheme's default stays the paper's 2.0 (docs/results/FORENSIC.md, at temperature 0.7 and above)
COMPANION_DELTA: Final = 4.0
# the companion's hash keys derive from HMAC-SHA256(secret, this label): independent of the primary's
_COMPANION_LABEL: Final = b"xmark/v1/encoder/biasing"


@dataclass(frozen=True, slots=True)
class KeyVersionSpec:
    """The encoders of one key version: the primary, and the biasing companion of a per-request
    version (None for a version of a single scheme)."""

    primary: WatermarkParams
    companion: WatermarkParams | None = None

    def __post_init__(self) -> None:
        companion = self.companion
        if companion is None:
            return
        if self.primary.scheme != PRIMARY_SCHEME or companion.scheme not in ("xmark", "loso", "mpac"):
            raise ParamsError(
                "a key version with two encoders pairs a 'gumbel' primary with a biasing companion "
                f"(got {self.primary.scheme!r} and {companion.scheme!r})"
            )
        if companion.bits != self.primary.bits:
            raise ParamsError(
                f"the companion encoder carries the primary's message length in bits "
                f"(got {companion.bits} and {self.primary.bits})"
            )

    @property
    def per_request(self) -> bool:
        """Whether the version carries both encoders (configured scheme ``auto``)."""
        return self.companion is not None

    @property
    def encoders(self) -> tuple[WatermarkParams, ...]:
        """The parameters of each encoder, primary first."""
        return (self.primary,) if self.companion is None else (self.primary, self.companion)

    @property
    def scheme(self) -> str:
        """The configured scheme this spec stands for: ``auto`` with a companion, else the primary's."""
        return PER_REQUEST if self.companion is not None else self.primary.scheme


def as_spec(params: WatermarkParams | KeyVersionSpec) -> KeyVersionSpec:
    """``params`` as a spec: a single scheme's parameters are a spec without a companion."""
    return params if isinstance(params, KeyVersionSpec) else KeyVersionSpec(params)


def companion_key(secret: str | bytes, params: WatermarkParams) -> WatermarkKey:
    """The companion encoder's key: ``params`` under a secret derived from ``secret`` with a label
    of its own, so its hash keys (and fingerprint) are independent of the primary's."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    return WatermarkKey.from_secret(hmac.new(raw, _COMPANION_LABEL, hashlib.sha256).digest(), params)


def encoder_keys(secret: str | bytes, spec: KeyVersionSpec) -> tuple[WatermarkKey, ...]:
    """The key of each encoder of ``spec`` (primary first), derived from the version's ``secret``."""
    keys = [WatermarkKey.from_secret(secret, spec.primary)]
    if spec.companion is not None:
        keys.append(companion_key(secret, spec.companion))
    return tuple(keys)


def spec_for(
    scheme: str,
    *,
    bits: int = 32,
    block_bits: int | None = None,
    num_keys: int | None = None,
    delta: float | None = None,
    min_entropy: float = 0.0,
    salts: int | None = None,
) -> KeyVersionSpec:
    """The encoders of a new key version of the configured ``scheme``.

    For a single scheme every argument applies to it (unset: the scheme's own defaults,
    ``xmark_core.params``). For ``auto``: ``block_bits`` and ``salts`` are the primary's (the
    distortion-free encoder: 8-bit blocks, 16 salts unless set), ``num_keys``, ``delta`` and
    ``min_entropy`` the companion's (the paper's XMark: 2-bit blocks, 4 keys unless set); both
    carry ``bits``. ``delta`` unset: 2.0 for a single biasing scheme, COMPANION_DELTA for the
    companion of ``auto``.
    """
    from .params import default_salts

    if scheme not in CONFIGURED_SCHEMES:
        raise ParamsError(f"scheme must be one of {', '.join(CONFIGURED_SCHEMES)} (got {scheme!r})")
    if scheme != PER_REQUEST:
        single: Scheme = scheme  # type: ignore[assignment]  # one of SCHEMES, checked above
        return KeyVersionSpec(
            WatermarkParams(
                bits=bits,
                block_bits=default_block_bits(single) if block_bits is None else block_bits,
                num_keys=default_num_keys(single) if num_keys is None else num_keys,
                delta=2.0 if delta is None else delta,
                scheme=single,
                min_entropy=min_entropy,
                salts=default_salts(single) if salts is None else salts,
            )
        )
    primary = WatermarkParams(
        bits=bits,
        block_bits=default_block_bits(PRIMARY_SCHEME) if block_bits is None else block_bits,
        num_keys=1,
        scheme=PRIMARY_SCHEME,
        salts=default_salts(PRIMARY_SCHEME) if salts is None else salts,
    )
    companion = WatermarkParams(
        bits=bits,
        block_bits=default_block_bits(COMPANION_SCHEME),
        num_keys=default_num_keys(COMPANION_SCHEME) if num_keys is None else num_keys,
        delta=COMPANION_DELTA if delta is None else delta,
        scheme=COMPANION_SCHEME,
        min_entropy=min_entropy,
    )
    return KeyVersionSpec(primary, companion)
