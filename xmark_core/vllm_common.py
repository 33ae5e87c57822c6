"""What the vLLM adapters share: the worker's keyring, per-request arguments, start-up checks.

Importing this module imports neither vLLM nor torch: the gateway imports it for the argument
names (``build_watermarkers`` imports the torch encoder when a worker starts), and ``vllm_v1`` and
``vllm_v2`` are the only modules that import vLLM.

Per-request arguments travel in ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``):
``xmark_message`` (the b-bit message as a string of '0'/'1') and ``xmark_key_version`` (the name of a
configured key version), both required; optional are ``xmark_encoder`` (``"companion"``: the key
version's biasing companion encoder, ``xmark_core.encoders``; ``"primary"`` or absent: its primary),
``xmark_salt`` (a salted ``gumbel`` encoder: the salt the answer is written under, an integer in
[0, S); 0 when absent; never sent with the companion) and ``xmark_fingerprint`` (the chosen
encoder's fingerprint as the gateway knows it: a worker whose key for that name differs, another
secret or other parameters, refuses the request rather than write a watermark /trace cannot read).
The message carries the chosen encoder's bits. A request without the two required ones is not
watermarked; a request with only one of them, a malformed value, an unknown key version, the
companion of a version that has none or any other ``xmark_*`` key is rejected when vLLM admits it
(HTTP 400), never inside the sampler.

An encoder of scheme ``gumbel`` (the primary of the default configured scheme ``auto``, or every
request's under ``XMARK_WATERMARK_SCHEME=gumbel``) chooses each token itself, by keyed sampling from
the model's distribution at the request's temperature, within its ``top_k`` / ``top_p`` / ``min_p``
(``xmark_core.gumbel``, applied before the choice as vLLM's sampler would), after which any sampler
returns that token. A sampling field vLLM applies after the processors would then be silently
ignored, so a request for a ``gumbel`` encoder with ``temperature`` 0, penalties, ``logit_bias`` or
``n`` > 1 (vLLM's child requests would share one salt, so their answers would be alike) is refused
at admission, naming the field. A request for a biasing encoder (``xmark``, ``loso``, ``mpac``: an
``auto`` version's companion among them) takes any sampling: the bias is added before vLLM's own.

The watermark secrets are read once per process, at start-up, from ``XMARK_WATERMARK_SECRETS``
(``name:secret[,name:secret...]``) or from the file named by ``XMARK_SECRETS_FILE`` (the same
entries, one per line, ``#`` starts a comment). The key versions' encoders come from
``XMARK_WATERMARK_SCHEME`` (``auto``, the default ``xmark_core.encoders.DEFAULT_CONFIGURED_SCHEME``,
or one of ``gumbel``, ``xmark``, ``loso``, ``mpac``), ``XMARK_WATERMARK_BITS``,
``XMARK_WATERMARK_BLOCK_BITS``, ``XMARK_WATERMARK_NUM_KEYS``, ``XMARK_WATERMARK_DELTA``,
``XMARK_WATERMARK_MIN_ENTROPY`` and ``XMARK_WATERMARK_SALTS`` (unset or empty: the default), read as
the gateway reads them (``xmark_core.encoders.spec_for``), so one env file configures both and the
worker derives the gateway's keys and fingerprints (``encoder_keys``). Error messages name the
variable and the rule, never a secret.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .encoders import DEFAULT_CONFIGURED_SCHEME, DEFAULT_MESSAGE_BITS, KeyVersionSpec, encoder_keys, spec_for
from .errors import RequestArgumentError
from .errors import WorkerConfigError as WorkerConfigError  # re-exported: its historic home
from .gumbel import salted
from .keys import MIN_SECRET_BYTES, WatermarkKey  # noqa: F401 - MIN_SECRET_BYTES is re-exported
from .message import bits_to_blocks
from .params import WatermarkParams
from .secrets import KEY_VERSION_NAME
from .secrets import parse_secret_entries as _parse_secret_entries

if TYPE_CHECKING:
    from vllm import SamplingParams

    from .encoder import TorchWatermarker

XARG_MESSAGE = "xmark_message"
XARG_KEY_VERSION = "xmark_key_version"
XARG_SALT = "xmark_salt"
XARG_FINGERPRINT = "xmark_fingerprint"
XARG_ENCODER = "xmark_encoder"
XARG_PREFIX = "xmark_"
REQUIRED_XARGS = frozenset({XARG_MESSAGE, XARG_KEY_VERSION})
KNOWN_XARGS = REQUIRED_XARGS | {XARG_SALT, XARG_FINGERPRINT, XARG_ENCODER}
# the values of XARG_ENCODER: the encoders of a key version (``xmark_core.encoders.KeyVersionSpec``)
ENCODER_PRIMARY = "primary"
ENCODER_COMPANION = "companion"
ENCODERS = (ENCODER_PRIMARY, ENCODER_COMPANION)

ENV_SECRETS = "XMARK_WATERMARK_SECRETS"
ENV_SECRETS_FILE = "XMARK_SECRETS_FILE"
ENV_BITS = "XMARK_WATERMARK_BITS"
ENV_BLOCK_BITS = "XMARK_WATERMARK_BLOCK_BITS"
ENV_NUM_KEYS = "XMARK_WATERMARK_NUM_KEYS"
ENV_DELTA = "XMARK_WATERMARK_DELTA"
ENV_MIN_ENTROPY = "XMARK_WATERMARK_MIN_ENTROPY"
ENV_SCHEME = "XMARK_WATERMARK_SCHEME"
ENV_SALTS = "XMARK_WATERMARK_SALTS"

ENV_PROFILE = "XMARK_PROCESSOR_PROFILE"  # benchmarks: a file the processor's time goes to

LOGITS_PROCESSORS_GROUP = "vllm.logits_processors"  # vLLM's entry-point group for processors

logger = logging.getLogger("vllm.xmark")  # under vLLM's logger, so its log configuration shows it


def parse_secret_entries(text: str, *, source: str) -> dict[str, bytes]:
    """``name:secret`` entries separated by commas or new lines; ``#`` starts a comment line.

    The gateway's rules (:func:`xmark_core.secrets.parse_secret_entries`), placeholder check
    included; problems raise :class:`WorkerConfigError`.
    """
    return _parse_secret_entries(text, source=source, error=WorkerConfigError)


def _int_setting(variables: Mapping[str, str], name: str, default: int) -> int:
    raw = variables.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorkerConfigError(f"{name} must be an integer") from None


def _optional_int_setting(variables: Mapping[str, str], name: str) -> int | None:
    raw = variables.get(name)
    if raw is None or not raw.strip():
        return None
    return _int_setting(variables, name, 0)


def _optional_float_setting(variables: Mapping[str, str], name: str) -> float | None:
    """None when unset or empty (the scheme's own default)."""
    raw = variables.get(name)
    return None if raw is None or not raw.strip() else _float_setting(variables, name, 0.0)


def _float_setting(variables: Mapping[str, str], name: str, default: float) -> float:
    raw = variables.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise WorkerConfigError(f"{name} must be a number") from None


@dataclass(frozen=True)
class WorkerKeyring:
    """The key versions a vLLM worker can watermark with, each with the encoders of ``spec``.

    Every encoder of every version has a key slot of its own (the adapters' per-row key index, one
    ``TorchWatermarker`` each, built for that encoder's parameters): slot i < len(names) is version
    ``names[i]``'s primary; under a spec with a companion (configured scheme ``auto``), slot
    len(names) + i is that version's companion. ``keys`` holds the key of each slot, in that order.
    """

    spec: KeyVersionSpec
    names: tuple[str, ...]
    keys: tuple[WatermarkKey, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.names or len(self.keys) != len(self.names) * len(self.spec.encoders):
            raise WorkerConfigError("the worker needs at least one key version")

    @classmethod
    def from_secrets(cls, secrets: Mapping[str, bytes], spec: KeyVersionSpec) -> WorkerKeyring:
        """Each version's encoder keys as the gateway derives them (``xmark_core.encoders.encoder_keys``)."""
        names = tuple(sorted(secrets))
        per_version = [encoder_keys(secrets[n], spec) for n in names]  # [version][encoder]
        keys = tuple(keys[encoder] for encoder in range(len(spec.encoders)) for keys in per_version)
        return cls(spec, names, keys)

    @classmethod
    def from_variables(cls, variables: Mapping[str, str]) -> WorkerKeyring:
        """Read the secrets and parameters from ``variables`` (the process environment at start-up).

        ``XMARK_WATERMARK_SCHEME`` unset or empty is the gateway's default configured scheme
        (``xmark_core.encoders.DEFAULT_CONFIGURED_SCHEME``, ``auto``: a gumbel primary and a biasing
        companion per version); the other variables unset or empty take ``spec_for``'s defaults.
        """
        inline = variables.get(ENV_SECRETS, "").strip()
        path = variables.get(ENV_SECRETS_FILE, "").strip()
        if inline and path:
            raise WorkerConfigError(f"set either {ENV_SECRETS} or {ENV_SECRETS_FILE}, not both")
        if inline:
            secrets = parse_secret_entries(inline, source=ENV_SECRETS)
        elif path:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise WorkerConfigError(f"cannot read {ENV_SECRETS_FILE} {path}: {exc.strerror}") from None
            secrets = parse_secret_entries(text, source=f"{ENV_SECRETS_FILE} {path}")
        else:
            raise WorkerConfigError(
                f"the XMark logits processor needs the watermark secrets: set {ENV_SECRETS} "
                f"or {ENV_SECRETS_FILE} in the worker's environment"
            )
        scheme = (variables.get(ENV_SCHEME) or "").strip() or DEFAULT_CONFIGURED_SCHEME
        try:
            spec = spec_for(
                scheme,
                bits=_int_setting(variables, ENV_BITS, DEFAULT_MESSAGE_BITS),
                block_bits=_optional_int_setting(variables, ENV_BLOCK_BITS),
                num_keys=_optional_int_setting(variables, ENV_NUM_KEYS),
                delta=_optional_float_setting(variables, ENV_DELTA),
                min_entropy=_float_setting(variables, ENV_MIN_ENTROPY, 0.0),
                salts=_optional_int_setting(variables, ENV_SALTS),
            )
        except (TypeError, ValueError) as exc:
            raise WorkerConfigError(f"invalid watermark parameters: {exc}") from None
        return cls.from_secrets(secrets, spec)

    @property
    def params(self) -> WatermarkParams:
        """The primary encoder's parameters (every slot's, for a spec of a single scheme)."""
        return self.spec.primary

    @property
    def slots(self) -> tuple[tuple[str, str], ...]:
        """(key version name, encoder) of each key slot, in slot order."""
        encoders = ENCODERS[: len(self.spec.encoders)]
        return tuple((name, encoder) for encoder in encoders for name in self.names)

    def index(self, name: str, encoder: str = ENCODER_PRIMARY) -> int | None:
        """The key slot of version ``name``'s ``encoder``; None: no such version, or no such encoder."""
        try:
            position = self.names.index(name)
        except ValueError:
            return None
        if encoder == ENCODER_PRIMARY:
            return position
        if encoder == ENCODER_COMPANION and self.spec.companion is not None:
            return len(self.names) + position
        return None

    def params_of(self, slot: int) -> WatermarkParams:
        """The parameters of key slot ``slot``'s encoder."""
        return self.keys[slot].params

    def describe(self) -> str:
        """Key version names with fingerprint prefixes, per encoder (safe to log)."""
        labels = [name if encoder == ENCODER_PRIMARY else f"{name} {encoder}" for name, encoder in self.slots]
        return ", ".join(f"{label} ({key.fingerprint[:12]})" for label, key in zip(labels, self.keys, strict=True))


def worker_environment() -> Mapping[str, str]:
    """The worker process's environment: the one place xmark_core reads it (the keyring, and the
    benchmarks' processor profile)."""
    return os.environ


@functools.cache
def worker_keyring() -> WorkerKeyring:
    """The keyring of this process, read from its environment once (start-up)."""
    return WorkerKeyring.from_variables(worker_environment())


def build_watermarkers(keyring: WorkerKeyring, vllm_config: Any, device: Any, *, fused: bool) -> list[TorchWatermarker]:
    """One ``TorchWatermarker`` per key slot of ``keyring`` (each encoder of each version, built for
    that encoder's parameters), in slot order.

    With ``fused`` each runs the fused (torch.compile) op, compiled here for the model's
    vocabulary at start-up rather than on the first request: a batch that mixes the slots of a
    distortion-free primary and a biasing companion calls each slot's op, already compiled.
    """
    from .encoder import TorchWatermarker  # torch: imported by the adapters only

    markers = [TorchWatermarker(key, compile=fused) for key in keyring.keys]
    model_config = getattr(vllm_config, "model_config", None)
    if fused and model_config is not None:
        width = int(model_config.get_vocab_size())
        for marker in markers:
            marker.warm_up(device, width)
    return markers


@dataclass(frozen=True)
class RequestWatermark:
    """What one request asks the sampler to do: the key slot (its encoder's, ``WorkerKeyring.slots``)
    and the message blocks (a ``gumbel`` encoder: the values under the request's salt, ``gumbel.salted``)."""

    key_index: int
    blocks: np.ndarray  # int64 [r] (r of the slot's encoder)
    salt: int = 0


def parse_request(extra_args: Mapping[str, Any] | None, keyring: WorkerKeyring) -> RequestWatermark | None:
    """The watermark of a request, None when it carries no XMark arguments.

    Raises :class:`RequestArgumentError`, a ValueError (vLLM answers HTTP 400), for malformed
    arguments; the message names the argument and the rule, never its value.
    """
    if not extra_args:
        return None
    if not isinstance(extra_args, Mapping):
        raise RequestArgumentError("extra_args must be an object")
    ours = {k for k in extra_args if isinstance(k, str) and k.startswith(XARG_PREFIX)}
    if not ours:
        return None
    unknown = sorted(ours - KNOWN_XARGS)
    if unknown:
        raise RequestArgumentError(
            f"unknown XMark argument(s) {', '.join(unknown)}; expected {XARG_MESSAGE} and {XARG_KEY_VERSION}, "
            f"optionally {XARG_ENCODER}, {XARG_SALT} and {XARG_FINGERPRINT}"
        )
    missing = sorted(REQUIRED_XARGS - ours)
    if missing:
        raise RequestArgumentError(
            f"XMark argument {missing[0]} is missing (both {XARG_MESSAGE} and {XARG_KEY_VERSION} are required)"
        )
    name = extra_args[XARG_KEY_VERSION]
    if not isinstance(name, str) or not KEY_VERSION_NAME.match(name):
        raise RequestArgumentError(f"{XARG_KEY_VERSION} must be a key version name")
    encoder = extra_args.get(XARG_ENCODER, ENCODER_PRIMARY)
    if not isinstance(encoder, str) or encoder not in ENCODERS:
        raise RequestArgumentError(f"{XARG_ENCODER} must be one of {', '.join(repr(e) for e in ENCODERS)}")
    if keyring.index(name) is None:
        raise RequestArgumentError(f"{XARG_KEY_VERSION} names a key version this worker is not configured with")
    index = keyring.index(name, encoder)
    if index is None:
        raise RequestArgumentError(
            f"{XARG_ENCODER} {encoder!r}: this worker's key version {name} has no companion encoder "
            f"(scheme {keyring.spec.scheme}; the companion is configured with scheme auto); configure it as the gateway"
        )
    params = keyring.params_of(index)
    message = extra_args[XARG_MESSAGE]
    if not isinstance(message, str) or len(message) != params.bits or message.strip("01"):
        raise RequestArgumentError(f"{XARG_MESSAGE} must be a string of exactly {params.bits} characters '0' or '1'")
    fingerprint = extra_args.get(XARG_FINGERPRINT)
    if fingerprint is not None and fingerprint != keyring.keys[index].fingerprint:
        raise RequestArgumentError(
            f"{XARG_FINGERPRINT} differs from this worker's key version {name} ({encoder} encoder): the worker holds "
            f"another secret or other watermark parameters ({params.scheme}, b={params.bits}, d={params.block_bits}, "
            f"k={params.num_keys}); configure it as the gateway"
        )
    if encoder == ENCODER_COMPANION and XARG_SALT in extra_args:
        raise RequestArgumentError(f"{XARG_SALT} applies to a salted gumbel encoder only, not the companion")
    salt = extra_args.get(XARG_SALT, 0)
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < params.salts:
        raise RequestArgumentError(f"{XARG_SALT} must be an integer in [0, {params.salts}) for this worker's key")
    blocks = bits_to_blocks([message], params)[0]
    if params.salts > 1:
        blocks = salted(blocks, salt, params)
    return RequestWatermark(index, blocks, salt)


# sampling fields vLLM applies after the logits processors that a ``gumbel`` worker's choice would
# ignore: refused (top-k, top-p and min-p the worker applies itself before its choice: nucleus_of)
_AFTER_THE_CHOICE = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
)


def nucleus_of(sampling_params: Any) -> tuple[float, float, float]:
    """(top_k, top_p, min_p) of a request as a ``gumbel`` worker truncates with them
    (:class:`xmark_core.gumbel.Truncation`): top_k 0 (off) for vLLM's 0, -1 or None; top_p 1 and
    min_p 0 when unset."""
    top_k = getattr(sampling_params, "top_k", None)
    top_p = getattr(sampling_params, "top_p", None)
    min_p = getattr(sampling_params, "min_p", None)
    return (
        float(top_k) if top_k is not None and top_k > 0 else 0.0,
        1.0 if top_p is None else float(top_p),
        0.0 if min_p is None else float(min_p),
    )


def check_keyed_sampling(sampling_params: Any, params: WatermarkParams) -> None:
    """A watermarked request the encoder of ``params`` can honour. A ``gumbel`` encoder samples from
    the model's distribution at the request's temperature, within its top-k / top-p / min-p (applied
    by the worker before its choice), so greedy decoding, the penalties vLLM applies after the
    processors and ``logit_bias`` (not offered under this scheme) are refused by name
    (:class:`RequestArgumentError`); ``n`` > 1 too (vLLM's child requests share the request's salt:
    send n requests). A biasing encoder (an ``auto`` version's companion) takes any request."""
    if not params.distortion_free:
        return
    temperature = getattr(sampling_params, "temperature", 1.0)
    if temperature is None or not temperature > 0.0:
        raise RequestArgumentError(
            "temperature must be above 0 under the distortion-free watermark (greedy decoding would carry none)"
        )
    for name, neutral in _AFTER_THE_CHOICE:
        value = getattr(sampling_params, name, neutral)
        if value is not None and value != neutral:
            raise RequestArgumentError(
                f"{name} is not supported under the distortion-free watermark: it samples every token itself"
            )
    if getattr(sampling_params, "logit_bias", None):
        raise RequestArgumentError("logit_bias is not supported under the distortion-free watermark")
    if int(getattr(sampling_params, "n", 1) or 1) > 1:
        raise RequestArgumentError(
            "n above 1 is not supported under the distortion-free watermark on vLLM workers: send n requests"
        )


def last_two(prompt: Sequence[int] | None, output: Sequence[int]) -> tuple[int, int]:
    """(x[t-2], x[t-1]) from a request's prompt and output so far; 0 stands in before the start.

    Output placeholders (-1, a token not yet known under async scheduling) are returned as they
    are; callers leave such rows unwatermarked for that step.
    """
    n_out = len(output)
    if n_out >= 2:
        return output[-2], output[-1]
    prompt = prompt or ()
    if n_out == 1:
        return (prompt[-1] if prompt else 0), output[-1]
    if len(prompt) >= 2:
        return prompt[-2], prompt[-1]
    return 0, (prompt[-1] if prompt else 0)


def refuse_speculative_decoding(vllm_config: Any) -> None:
    """Speculative decoding scores draft tokens with logits the watermark does not see."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise WorkerConfigError(
            "the XMark watermark does not support speculative decoding: draft tokens would be "
            "accepted without the watermark bias; start vLLM without --speculative-config"
        )


def _resolve(entry: str | type) -> object:
    if isinstance(entry, type):
        return entry
    module_name, _, qualname = entry.partition(":")
    obj: object = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def count_loads(configured: Iterable[str | type], plugins: Iterable[object], base: type) -> int:
    """How many processors derived from ``base`` vLLM will build from these two sources."""
    count = 0
    for obj in [*(_resolve(e) for e in configured), *plugins]:
        if isinstance(obj, type) and issubclass(obj, base):
            count += 1
    return count


def refuse_duplicate_load(vllm_config: Any, base: type) -> None:
    """Refuse to start when the processor is reachable twice (δ would be added twice).

    vLLM builds one instance per entry of ``--logits-processors`` and one per
    ``vllm.logits_processors`` entry point; the same class reachable both ways (or listed twice)
    would bias every row twice.
    """
    model_config = getattr(vllm_config, "model_config", None)
    configured = getattr(model_config, "logits_processors", None) or ()
    plugins = [ep.load() for ep in entry_points(group=LOGITS_PROCESSORS_GROUP)]
    loads = count_loads(configured, plugins, base)
    if loads > 1:
        raise WorkerConfigError(
            f"the XMark logits processor is loaded {loads} times (through --logits-processors "
            f"and/or the '{LOGITS_PROCESSORS_GROUP}' entry point); it must be loaded exactly once, "
            "or the watermark bias would be added more than once"
        )


def start_worker(vllm_config: Any, processor: type) -> WorkerKeyring:
    """The start-up both adapters' processors run: the checks, then this process's keyring.

    Refuses speculative decoding and a second load of ``processor`` (:class:`WorkerConfigError`);
    the keyring is read from the environment on the first call and cached.
    """
    refuse_speculative_decoding(vllm_config)
    refuse_duplicate_load(vllm_config, processor)
    return worker_keyring()


class ProcessorProfile:
    """Cumulative time a processor spends per engine step, for benchmarks (never in production).

    When ``XMARK_PROCESSOR_PROFILE`` names a file, the processor times its ``apply`` and
    ``update_state`` calls and rewrites one line of counters (:attr:`FIELDS`) after each call. One
    ``pwrite`` of a fixed-width line costs a few microseconds and needs no flush at exit (the
    engine is killed, not shut down).
    A benchmark reads the line between rounds (:func:`read_processor_profile`).
    """

    FIELDS = ("applies", "apply_s", "watermarked_applies", "watermarked_apply_s", "updates", "update_s")

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.applies = 0
        self.apply_s = 0.0
        self.watermarked_applies = 0
        self.watermarked_apply_s = 0.0
        self.updates = 0
        self.update_s = 0.0

    @classmethod
    def from_environment(cls) -> ProcessorProfile | None:
        path = worker_environment().get(ENV_PROFILE)
        return cls(path) if path else None

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def applied(self, seconds: float, *, watermarked: bool) -> None:
        self.applies += 1
        self.apply_s += seconds
        if watermarked:
            self.watermarked_applies += 1
            self.watermarked_apply_s += seconds
        self._write()

    def updated(self, seconds: float) -> None:
        self.updates += 1
        self.update_s += seconds
        self._write()

    def _write(self) -> None:
        line = " ".join(
            f"{getattr(self, name):.9f}" if name.endswith("_s") else str(getattr(self, name)) for name in self.FIELDS
        )
        os.pwrite(self._fd, line.ljust(160).encode() + b"\n", 0)


def read_processor_profile(path: str | Path) -> dict[str, float]:
    """The counters a :class:`ProcessorProfile` last wrote (zeros before its first call)."""
    text = Path(path).read_text().split()
    if len(text) != len(ProcessorProfile.FIELDS):
        return dict.fromkeys(ProcessorProfile.FIELDS, 0.0)
    return {name: float(value) for name, value in zip(ProcessorProfile.FIELDS, text, strict=True)}


class ValidatesXMarkArguments:
    """Mixed into both adapters' processors, ahead of vLLM's ``LogitsProcessor`` base class.

    vLLM calls ``validate_params`` on every processor class when it admits a request, before the
    request reaches a worker's batch, and answers a ValueError with HTTP 400.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Reject malformed XMark arguments, and a request for a ``gumbel`` encoder that it could not
        honour (:class:`RequestArgumentError`); accept the rest (a biasing encoder's: any sampling)."""
        keyring = worker_keyring()
        mark = parse_request(sampling_params.extra_args, keyring)
        if mark is not None:
            check_keyed_sampling(sampling_params, keyring.params_of(mark.key_index))
