"""Which encoder writes a request's watermark: the one rule, and the refusals of a single-scheme
distortion-free version.

A per-request key version (configured scheme ``auto``, ``xmark_core.encoders``) carries two
encoders. The distortion-free keyed sampler (``gumbel``, the primary) writes the message into the
sampling draw: it leaves the answers' distribution unchanged, but carries a message only where the
request leaves the model a choice. The paper's XMark bias (the companion) marks every answer, greedy
ones included, at a price in quality. So the companion writes a request when any of these holds,
the primary otherwise:

* the temperature is below ``XMARK_WATERMARK_SAMPLING_MIN_TEMPERATURE`` (greedy decoding included):
  the draw has too little randomness to carry the message (docs/results/TEMPERATURE.md measures
  where the keyed sampler stops naming its author);
* ``top_p`` is below ``XMARK_WATERMARK_SAMPLING_MIN_TOP_P``, or ``top_k`` is 1: a nucleus of a
  few tokens is as near greedy as a low temperature;
* a sampling field the keyed sampler cannot honour is set (``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``): a backend applies them after the
  processors, where the keyed choice would ignore them;
* ``n`` > 1 on a backend whose n answers would share one salt (vLLM's child requests): they would
  be alike.

No request is refused for the watermark's sake under a per-request version. A backend that serves
only the primary (``Backend.encoders_per_request`` false) and a version of the single scheme
``gumbel`` keep the refusals by name of what the keyed sampler cannot carry
(:func:`check_keyed_sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.backends.base import GREEDY_TEMPERATURE
from service.errors import InvalidRequestError, ServiceUnavailableError
from service.services.request_fields import NEUTRAL_VALUES, equals_neutral

if TYPE_CHECKING:
    from service.fleet import ServedModel
    from service.keyring import KeyVersionHandle
    from service.schemas.chat import SamplingRequest
    from xmark_core import WatermarkKey

# sampling fields the keyed sampler cannot honour: a backend applies them after its processors,
# where the keyed choice would ignore them (top_p, top_k and min_p the keyed sampler applies itself)
KEYED_SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


@dataclass(frozen=True)
class EncoderRule:
    """The thresholds of the choice (settings fill them)."""

    min_temperature: float
    min_top_p: float


@dataclass(frozen=True)
class EncoderChoice:
    """The encoder a request is written by, and why (``reason``: the field that sent it to the
    companion, "" for the primary)."""

    key: WatermarkKey
    companion: bool
    reason: str = ""


def _sampling(body: SamplingRequest) -> tuple[float, float]:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return temperature, top_p


def companion_reason(
    body: SamplingRequest, options: Mapping[str, object], *, served: ServedModel, rule: EncoderRule
) -> str:
    """The first field that sends a request to the companion encoder ("" when none does)."""
    temperature, top_p = _sampling(body)
    if temperature < max(rule.min_temperature, GREEDY_TEMPERATURE):
        return "temperature"
    if top_p < rule.min_top_p:
        return "top_p"
    if equals_neutral(options.get("top_k"), (1,)):
        return "top_k"
    for name in KEYED_SAMPLING_FIELDS:
        if not equals_neutral(options.get(name), NEUTRAL_VALUES[name]):
            return name
    if (body.n or 1) > 1 and not served.backend.salts_per_answer:
        return "n"
    return ""


def choose_encoder(
    handle: KeyVersionHandle,
    served: ServedModel,
    body: SamplingRequest,
    options: Mapping[str, object],
    *,
    rule: EncoderRule,
) -> EncoderChoice:
    """The encoder of ``handle`` (the active key version) that writes this request.

    A per-request version on a backend that serves both: the companion where
    :func:`companion_reason` names a field, else the primary. Otherwise the version's one (primary)
    encoder; a distortion-free one refuses by name what it cannot carry (:func:`check_keyed_sampling`).
    """
    if handle.companion is not None and served.backend.encoders_per_request:
        reason = companion_reason(body, options, served=served, rule=rule)
        if reason:
            return EncoderChoice(handle.companion, True, reason)
        return EncoderChoice(handle.key, False)
    if handle.key.params.distortion_free:
        check_keyed_sampling(handle.name, handle.key.params.scheme, served, body, options)
    return EncoderChoice(handle.key, False)


def check_keyed_sampling(
    version: str,
    scheme: str,
    served: ServedModel,
    body: SamplingRequest,
    options: Mapping[str, object] | None = None,
) -> None:
    """A distortion-free encoder serving every request of its version (a ``gumbel`` version, or a
    per-request version on a backend that serves its primary alone) chooses every token itself,
    from the model's distribution at the request's temperature within its nucleus (``top_p``;
    ``top_k`` and ``min_p`` on vLLM): a backend that cannot sample with it does not serve it, and a
    greedy request or a sampling field it could not honour (penalties, ``logit_bias``) is refused
    by name rather than answered without the watermark or from another distribution. On a backend
    whose n answers of one request would share one salt (``Backend.salts_per_answer`` false: vLLM's
    child requests), ``n`` > 1 is refused too (they would be alike)."""
    if scheme not in served.backend.schemes:
        raise ServiceUnavailableError(
            f"The active watermark key version '{version}' uses the '{scheme}' scheme, which the backend of "
            f"model '{served.name}' does not serve",
            code="scheme_not_served",
        )
    if body.temperature is not None and body.temperature < GREEDY_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature {body.temperature:g} (greedy decoding) cannot carry the distortion-free watermark of "
            f"key version '{version}': it writes the watermark into the sampling draw; use a temperature above 0",
            param="temperature",
            code="unsupported_value",
        )
    for name in KEYED_SAMPLING_FIELDS:
        if not equals_neutral((options or {}).get(name), NEUTRAL_VALUES[name]):
            raise InvalidRequestError(
                f"{name} is not supported with the distortion-free watermark of key version '{version}': it "
                "samples every token itself from the model's distribution at the request's temperature",
                param=name,
                code="unsupported_value",
            )
    if (body.n or 1) > 1 and not served.backend.salts_per_answer:
        raise InvalidRequestError(
            f"n above 1 is not supported with the distortion-free watermark of key version '{version}' on model "
            f"'{served.name}': its workers would write the n answers under one salt, alike; send n requests",
            param="n",
            code="unsupported_value",
        )
