"""Worker configuration, per-request arguments and start-up checks shared by the vLLM adapters."""

from __future__ import annotations

import collections
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from xmark_core import Message, WatermarkKey, WatermarkParams, vllm_common
from xmark_core.encoders import (
    COMPANION_DELTA,
    DEFAULT_CONFIGURED_SCHEME,
    DEFAULT_MESSAGE_BITS,
    KeyVersionSpec,
    encoder_keys,
    spec_for,
)
from xmark_core.errors import RequestArgumentError
from xmark_core.vllm_common import (
    ENV_BITS,
    ENV_BLOCK_BITS,
    ENV_DELTA,
    ENV_MIN_ENTROPY,
    ENV_NUM_KEYS,
    ENV_SALTS,
    ENV_SCHEME,
    ENV_SECRETS,
    ENV_SECRETS_FILE,
    XARG_ENCODER,
    XARG_FINGERPRINT,
    XARG_KEY_VERSION,
    XARG_MESSAGE,
    XARG_SALT,
    WorkerConfigError,
    WorkerKeyring,
    check_keyed_sampling,
    count_loads,
    last_two,
    parse_request,
    refuse_duplicate_load,
    refuse_speculative_decoding,
)

SECRET_A = "alpha-secret-0123456789abcdef"
SECRET_B = "bravo-secret-fedcba9876543210"


# -- worker keyring --------------------------------------------------------------------------


def test_keyring_from_inline_secrets_derives_the_gateway_keys() -> None:
    from service.config import Settings
    from service.keyring import params_from_settings, spec_from_settings

    keyring = WorkerKeyring.from_variables({ENV_SECRETS: f"v2:{SECRET_B}, v1:{SECRET_A}"})
    assert keyring.names == ("v1", "v2")
    # unset parameters default to the gateway's defaults: one env file (or none) configures both.
    # The defaults: the configured scheme auto, a distortion-free primary in 8-bit blocks, 1 key,
    # 16 salts, and a biasing companion
    fields = Settings.model_fields
    defaults = Settings.model_construct(**{n: f.default for n, f in fields.items()})
    gateway = params_from_settings(defaults)
    assert (
        keyring.spec == spec_from_settings(defaults) == spec_for(DEFAULT_CONFIGURED_SCHEME, bits=DEFAULT_MESSAGE_BITS)
    )
    assert keyring.spec.scheme == DEFAULT_CONFIGURED_SCHEME == "auto"
    assert keyring.params == gateway
    assert gateway == WatermarkParams(bits=64, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
    # an empty XMARK_WATERMARK_DELTA (the compose and ConfigMap default) is unset: the companion's own bias
    empty = WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}", ENV_DELTA: ""})
    assert empty.spec == keyring.spec and empty.spec.companion is not None
    assert empty.spec.companion.delta == COMPANION_DELTA != 2.0
    # the biasing scheme named alone takes its own defaults, in both
    biasing = WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "xmark"})
    assert biasing.params == WatermarkParams(bits=64, block_bits=2, num_keys=4, scheme="xmark")
    assert biasing.params == params_from_settings(
        Settings.model_construct(**{**{n: f.default for n, f in fields.items()}, "watermark_scheme": "xmark"})
    )
    # the same secret and parameters give the same key the gateway derives
    assert keyring.keys[0].fingerprint == WatermarkKey.from_secret(SECRET_A, gateway).fingerprint
    assert keyring.index("v2") == 1
    assert keyring.index("v3") is None


def test_keyring_from_secrets_file_and_parameters(tmp_path: Path) -> None:
    path = tmp_path / "secrets"
    path.write_text(f"# rotated 2024\nold:{SECRET_A}\nnew:{SECRET_B}\n")
    keyring = WorkerKeyring.from_variables(
        {ENV_SECRETS_FILE: str(path), ENV_SCHEME: "xmark", ENV_BITS: "24", ENV_DELTA: "3.5"}
    )
    assert keyring.names == ("new", "old")
    assert keyring.params.bits == 24 and keyring.params.delta == 3.5
    assert keyring.params.min_entropy == 0.0  # unset: every position biased, as every earlier version
    ruled = WorkerKeyring.from_variables({ENV_SECRETS_FILE: str(path), ENV_SCHEME: "xmark", ENV_MIN_ENTROPY: "0.69"})
    assert ruled.params.min_entropy == 0.69
    # the gateway's key version with the same rule has the same fingerprint
    assert (
        ruled.keys[1].fingerprint
        == WatermarkKey.from_secret(SECRET_A, WatermarkParams(min_entropy=0.69, bits=64, num_keys=4)).fingerprint
    )


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({}, "needs the watermark secrets"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SECRETS_FILE: "/x"}, "not both"),
        ({ENV_SECRETS: SECRET_A}, "name:secret"),
        ({ENV_SECRETS: "v1:short"}, "shorter than 16 bytes"),
        ({ENV_SECRETS: f"v1:{SECRET_A},v1:{SECRET_B}"}, "listed twice"),
        ({ENV_SECRETS: f"bad name:{SECRET_A}"}, "must match"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_BITS: "15"}, "invalid watermark parameters"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_BITS: "sixteen"}, "must be an integer"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "xmark", ENV_MIN_ENTROPY: "-1"}, "invalid watermark parameters"),
        # the entropy rule of a biasing encoder: not for gumbel, the companion's under auto
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "gumbel", ENV_MIN_ENTROPY: "0.5"}, "invalid watermark parameters"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "auto", ENV_NUM_KEYS: "9"}, "invalid watermark parameters"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "auto", ENV_BLOCK_BITS: "9"}, "invalid watermark parameters"),
        ({ENV_SECRETS: f"v1:{SECRET_A}", ENV_MIN_ENTROPY: "high"}, "must be a number"),
        ({ENV_SECRETS_FILE: "/nonexistent/xmark-secrets"}, "cannot read"),
    ],
)
def test_keyring_configuration_errors_are_clear_and_never_show_a_secret(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(WorkerConfigError) as caught:
        WorkerKeyring.from_variables(environ)
    assert fragment in str(caught.value)
    assert SECRET_A not in str(caught.value) and SECRET_B not in str(caught.value)


def test_keyring_description_shows_fingerprint_prefixes_only() -> None:
    keyring = WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}"})
    text = keyring.describe() + repr(keyring)
    assert "v1 (" in text and keyring.keys[0].fingerprint[:12] in text
    assert SECRET_A not in text and keyring.keys[0].fingerprint not in text
    both = WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "auto"})
    text = both.describe() + repr(both)
    assert f"v1 ({both.keys[0].fingerprint[:12]})" in text and f"v1 companion ({both.keys[1].fingerprint[:12]})" in text
    assert SECRET_A not in text and not any(key.fingerprint in text for key in both.keys)


# -- key versions of two encoders (configured scheme auto) ---------------------------------


def test_an_auto_keyring_derives_the_gateways_keys_of_both_encoders() -> None:
    """XMARK_WATERMARK_SCHEME=auto: each version has a gumbel primary slot and a biasing companion
    slot, keyed as the gateway keys them (xmark_core.encoders.encoder_keys), fingerprints included;
    the parameter variables configure both as spec_for reads them, empty ones taking the default."""
    secrets = {"v1": SECRET_A, "v2": SECRET_B}
    variables = {ENV_SECRETS: ",".join(f"{k}:{v}" for k, v in secrets.items()), ENV_SCHEME: "auto"}
    for settings, spec in (
        ({}, spec_for("auto", bits=DEFAULT_MESSAGE_BITS)),
        (
            {ENV_BITS: "", ENV_BLOCK_BITS: " ", ENV_NUM_KEYS: "", ENV_SALTS: "", ENV_DELTA: ""},
            spec_for("auto", bits=DEFAULT_MESSAGE_BITS),
        ),
        (
            {
                ENV_BITS: "24",
                ENV_BLOCK_BITS: "4",
                ENV_SALTS: "8",
                ENV_NUM_KEYS: "2",
                ENV_DELTA: "3",
                ENV_MIN_ENTROPY: "0.3",
            },
            spec_for("auto", bits=24, block_bits=4, salts=8, num_keys=2, delta=3.0, min_entropy=0.3),
        ),
    ):
        keyring = WorkerKeyring.from_variables({**variables, **settings})
        assert keyring.spec == spec and spec.companion is not None
        assert keyring.slots == (("v1", "primary"), ("v2", "primary"), ("v1", "companion"), ("v2", "companion"))
        assert keyring.params == spec.primary
        for position, name in enumerate(keyring.names):
            primary, companion = encoder_keys(secrets[name], spec)
            assert keyring.index(name) == keyring.index(name, "primary") == position
            assert keyring.keys[position].fingerprint == primary.fingerprint
            slot = keyring.index(name, "companion")
            assert slot == len(keyring.names) + position
            assert slot is not None and keyring.keys[slot].fingerprint == companion.fingerprint
            assert keyring.params_of(slot) == spec.companion and keyring.params_of(position) == spec.primary
        assert len({key.fingerprint for key in keyring.keys}) == 4
    # the default configured scheme is auto, the gateway's too
    assert WorkerKeyring.from_variables({ENV_SECRETS: variables[ENV_SECRETS]}).spec == spec_for(
        "auto", bits=DEFAULT_MESSAGE_BITS
    )
    # a version of a single scheme has one encoder: no companion slot
    single = WorkerKeyring.from_variables({**variables, ENV_SCHEME: "xmark"})
    assert single.spec == KeyVersionSpec(spec_for("xmark", bits=DEFAULT_MESSAGE_BITS).primary) and single.slots == (
        ("v1", "primary"),
        ("v2", "primary"),
    )
    assert single.index("v1", "companion") is None and single.index("v3", "companion") is None


@pytest.fixture
def auto_keys() -> WorkerKeyring:
    """Workers of a 32-bit per-request deployment (one configured before the default became 64)."""
    return WorkerKeyring.from_variables(
        {ENV_SECRETS: f"v1:{SECRET_A},v2:{SECRET_B}", ENV_SCHEME: "auto", ENV_BITS: "32"}
    )


BITS_32 = "01101100000110111001001101100100"


def test_a_request_selects_its_versions_companion_or_primary(auto_keys: WorkerKeyring) -> None:
    """xmark_encoder "companion" names the version's companion slot (its own blocks and fingerprint);
    "primary" or no xmark_encoder its primary (salted as before)."""
    companion = auto_keys.spec.companion
    assert companion is not None
    slot = auto_keys.index("v2", "companion")
    assert slot is not None
    fingerprint = auto_keys.keys[slot].fingerprint
    mark = parse_request(
        {XARG_MESSAGE: BITS_32, XARG_KEY_VERSION: "v2", XARG_ENCODER: "companion", XARG_FINGERPRINT: fingerprint},
        auto_keys,
    )
    assert mark is not None and mark.key_index == slot and mark.salt == 0
    np.testing.assert_array_equal(mark.blocks, Message.from_bits(BITS_32, companion).blocks)
    assert mark.blocks.shape == (companion.num_blocks,) == (16,)
    primary_blocks = Message.from_bits(BITS_32, auto_keys.params).blocks
    for extra in ({}, {XARG_ENCODER: "primary"}):
        mark = parse_request({XARG_MESSAGE: BITS_32, XARG_KEY_VERSION: "v2", XARG_SALT: 3, **extra}, auto_keys)
        assert mark is not None and mark.key_index == auto_keys.index("v2") == 1 and mark.salt == 3
        np.testing.assert_array_equal(mark.blocks, primary_blocks + 3 * 256)
    # each encoder's fingerprint is its own: the primary's does not pass for the companion, nor back
    primary_fingerprint = auto_keys.keys[1].fingerprint
    with pytest.raises(RequestArgumentError, match=r"xmark_fingerprint differs .* v2 \(companion encoder\)"):
        parse_request(
            {
                XARG_MESSAGE: BITS_32,
                XARG_KEY_VERSION: "v2",
                XARG_ENCODER: "companion",
                XARG_FINGERPRINT: primary_fingerprint,
            },
            auto_keys,
        )
    with pytest.raises(RequestArgumentError, match="xmark_fingerprint differs"):
        parse_request({XARG_MESSAGE: BITS_32, XARG_KEY_VERSION: "v2", XARG_FINGERPRINT: fingerprint}, auto_keys)


@pytest.mark.parametrize(
    ("extra_args", "fragment"),
    [
        ({XARG_ENCODER: "biasing"}, "xmark_encoder must be one of 'primary', 'companion'"),
        ({XARG_ENCODER: 1}, "xmark_encoder must be one of"),
        ({XARG_ENCODER: None}, "xmark_encoder must be one of"),
        ({XARG_ENCODER: "companion", XARG_SALT: 0}, "xmark_salt applies to a salted gumbel encoder only"),
        ({XARG_ENCODER: "companion", XARG_SALT: 3}, "xmark_salt applies to a salted gumbel encoder only"),
        ({XARG_ENCODER: "companion", XARG_MESSAGE: "0" * 16}, "exactly 32 characters"),
        ({XARG_ENCODER: "companion", XARG_KEY_VERSION: "v9"}, "not configured"),
    ],
)
def test_malformed_encoder_arguments_are_rejected_by_name(
    auto_keys: WorkerKeyring, extra_args: dict, fragment: str
) -> None:
    with pytest.raises(RequestArgumentError) as caught:
        parse_request({XARG_MESSAGE: BITS_32, XARG_KEY_VERSION: "v1", **extra_args}, auto_keys)
    assert fragment in str(caught.value)
    assert "biasing" not in str(caught.value)  # the value is not echoed


def test_the_companion_of_a_single_scheme_version_is_refused(two_keys: WorkerKeyring) -> None:
    with pytest.raises(RequestArgumentError, match="key version v1 has no companion encoder") as caught:
        parse_request({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: "v1", XARG_ENCODER: "companion"}, two_keys)
    assert "scheme xmark" in str(caught.value)
    # "primary" is the one encoder of such a version
    mark = parse_request({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: "v1", XARG_ENCODER: "primary"}, two_keys)
    assert mark is not None and mark.key_index == 0


def test_keyed_sampling_rules_follow_the_chosen_encoder(auto_keys: WorkerKeyring) -> None:
    """The refusals of a gumbel encoder (greedy, penalties, logit_bias, n > 1) apply to a request for
    the primary; a request for the companion takes them all."""
    companion = auto_keys.spec.companion
    assert companion is not None
    for fields in (
        {"temperature": 0.0},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {5: 2.0}},
        {"n": 3},
    ):
        request = SimpleNamespace(**{"temperature": 0.7, "n": 1, **fields})
        check_keyed_sampling(request, companion)
        with pytest.raises(RequestArgumentError, match="distortion-free"):
            check_keyed_sampling(request, auto_keys.params)


# -- per-request arguments -------------------------------------------------------------------


@pytest.fixture
def two_keys() -> WorkerKeyring:
    return WorkerKeyring.from_variables(
        {ENV_SECRETS: f"v1:{SECRET_A},v2:{SECRET_B}", ENV_SCHEME: "xmark", ENV_BITS: "16"}
    )


@pytest.mark.parametrize("extra_args", [None, {}, {"session_id": "abc", "other": 1}])
def test_requests_without_xmark_arguments_are_not_watermarked(two_keys: WorkerKeyring, extra_args: object) -> None:
    assert parse_request(extra_args, two_keys) is None  # type: ignore[arg-type]  # None and plain dicts on purpose


def test_a_well_formed_request_names_its_key_slot_and_message_blocks(two_keys: WorkerKeyring) -> None:
    bits = "0110110000011011"
    mark = parse_request({XARG_MESSAGE: bits, XARG_KEY_VERSION: "v2", "session_id": "s"}, two_keys)
    assert mark is not None
    assert mark.key_index == 1
    np.testing.assert_array_equal(mark.blocks, Message.from_bits(bits, two_keys.params).blocks)
    assert mark.blocks.dtype == np.int64


def test_a_gumbel_worker_reads_its_scheme_salts_and_each_requests_salt() -> None:
    """XMARK_WATERMARK_SCHEME / _SALTS configure the worker as the gateway (16 salts for gumbel unless
    set); a request's salt selects its values (v + salt * 2**d), its fingerprint must be the worker's."""
    variables = {ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "gumbel", ENV_BLOCK_BITS: "8", ENV_NUM_KEYS: "1"}
    keyring = WorkerKeyring.from_variables(variables)
    assert keyring.params == WatermarkParams(bits=64, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
    assert WorkerKeyring.from_variables({**variables, ENV_SALTS: "1"}).params.salts == 1
    with pytest.raises(WorkerConfigError, match="salts applies to scheme 'gumbel' only"):
        WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "xmark", ENV_SALTS: "4"})
    with pytest.raises(WorkerConfigError, match="scheme must be one of"):
        WorkerKeyring.from_variables({**variables, ENV_SCHEME: "bogus"})
    bits = "01101100000110111001001101100100" * 2
    blocks = Message.from_bits(bits, keyring.params).blocks
    fingerprint = keyring.keys[0].fingerprint
    mark = parse_request(
        {XARG_MESSAGE: bits, XARG_KEY_VERSION: "v1", XARG_SALT: 5, XARG_FINGERPRINT: fingerprint}, keyring
    )
    assert mark is not None and mark.salt == 5
    np.testing.assert_array_equal(mark.blocks, blocks + 5 * 256)
    unsalted = parse_request({XARG_MESSAGE: bits, XARG_KEY_VERSION: "v1"}, keyring)
    assert unsalted is not None and unsalted.salt == 0
    np.testing.assert_array_equal(unsalted.blocks, blocks)
    for salt in (16, -1, "3", True, 2.0):
        with pytest.raises(RequestArgumentError, match=r"xmark_salt must be an integer in \[0, 16\)"):
            parse_request({XARG_MESSAGE: bits, XARG_KEY_VERSION: "v1", XARG_SALT: salt}, keyring)
    # a gateway whose key version differs (another secret, other parameters) is refused, naming the rule
    other = WatermarkKey.from_secret(SECRET_A, WatermarkParams(bits=32, num_keys=4)).fingerprint
    with pytest.raises(RequestArgumentError, match="xmark_fingerprint differs") as refused:
        parse_request({XARG_MESSAGE: bits, XARG_KEY_VERSION: "v1", XARG_FINGERPRINT: other}, keyring)
    assert SECRET_A not in str(refused.value) and fingerprint not in str(refused.value)
    # an unsalted worker takes salt 0 only
    biasing = WorkerKeyring.from_variables({ENV_SECRETS: f"v1:{SECRET_A}", ENV_SCHEME: "xmark"})
    with pytest.raises(RequestArgumentError, match=r"in \[0, 1\)"):
        parse_request({XARG_MESSAGE: bits, XARG_KEY_VERSION: "v1", XARG_SALT: 1}, biasing)


@pytest.mark.parametrize(
    ("extra_args", "fragment"),
    [
        ({XARG_MESSAGE: "0" * 16}, "xmark_key_version is missing"),
        ({XARG_KEY_VERSION: "v1"}, "xmark_message is missing"),
        ({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: "v1", "xmark_delta": 9}, "unknown XMark argument(s) xmark_delta"),
        ({XARG_MESSAGE: "0" * 15, XARG_KEY_VERSION: "v1"}, "exactly 16 characters"),
        ({XARG_MESSAGE: "0" * 15 + "2", XARG_KEY_VERSION: "v1"}, "exactly 16 characters"),
        ({XARG_MESSAGE: 12345, XARG_KEY_VERSION: "v1"}, "exactly 16 characters"),
        ({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: 1}, "must be a key version name"),
        ({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: "v9"}, "not configured"),
    ],
)
def test_malformed_arguments_are_rejected_with_the_rule(
    two_keys: WorkerKeyring, extra_args: dict, fragment: str
) -> None:
    with pytest.raises(ValueError) as caught:
        parse_request(extra_args, two_keys)
    assert fragment in str(caught.value)


def test_rejections_do_not_echo_the_submitted_values(two_keys: WorkerKeyring) -> None:
    with pytest.raises(ValueError) as caught:
        parse_request({XARG_MESSAGE: "0" * 16, XARG_KEY_VERSION: "attacker-chosen"}, two_keys)
    assert "attacker-chosen" not in str(caught.value)


# -- context of a step -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "output", "expected"),
    [
        ([5, 6, 7], [], (6, 7)),
        ([5, 6, 7], [8], (7, 8)),
        ([5, 6, 7], [8, 9, 10], (9, 10)),
        ([7], [], (0, 7)),
        ([], [], (0, 0)),
        (None, [8], (0, 8)),
        ([5, 6], [8, -1], (8, -1)),  # placeholder left visible: callers skip the row
    ],
)
def test_last_two_tokens_of_prompt_and_output(
    prompt: list[int] | None, output: list[int], expected: tuple[int, int]
) -> None:
    assert last_two(prompt, output) == expected


# -- start-up checks -------------------------------------------------------------------------


def test_speculative_decoding_is_refused_at_start_up() -> None:
    refuse_speculative_decoding(SimpleNamespace(speculative_config=None))
    with pytest.raises(WorkerConfigError, match="does not support speculative decoding"):
        refuse_speculative_decoding(SimpleNamespace(speculative_config=object()))


def test_count_loads_counts_every_route_to_the_processor() -> None:
    assert count_loads([], [], dict) == 0
    assert count_loads(["collections:OrderedDict"], [], dict) == 1
    assert count_loads(["collections:OrderedDict"], [collections.OrderedDict], dict) == 2
    assert count_loads([collections.OrderedDict, "collections:Counter"], [list], dict) == 2
    assert count_loads(["collections:deque"], [list], dict) == 0


def test_loading_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = EntryPoint("xmark", "collections:OrderedDict", vllm_common.LOGITS_PROCESSORS_GROUP)
    monkeypatch.setattr(vllm_common, "entry_points", lambda group: [plugin] if group == plugin.group else [])
    once = SimpleNamespace(model_config=SimpleNamespace(logits_processors=None))
    refuse_duplicate_load(once, dict)  # entry point only: fine
    twice = SimpleNamespace(model_config=SimpleNamespace(logits_processors=["collections:OrderedDict"]))
    with pytest.raises(WorkerConfigError, match="loaded 2 times"):
        refuse_duplicate_load(twice, dict)
