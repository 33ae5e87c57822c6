"""The torch encoder op: boosted fractions, exact bias, per-row messages, dtypes, input checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from xmark_core import TorchWatermarker, WatermarkKey, WatermarkParams, apply_watermark, shard
from xmark_core.params import Scheme

from .synthetic import SECRET


def _key(**fields: Any) -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, WatermarkParams(**fields))


def _inputs(params: WatermarkParams, batch: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)  # [B, V]
    context = torch.randint(0, 2**31 - 1, (batch, 2), generator=g)  # [B, 2] prompt ids may exceed V
    context[: batch // 4] = torch.randint(0, vocab, (batch // 4, 2), generator=g)
    if batch > 2:
        context[0] = 0  # context (0, 0)
        context[1, 0] = 0
    blocks = torch.randint(0, params.num_shards, (batch, params.num_blocks), generator=g)  # [B, r]
    active = torch.rand(batch, generator=g) < 0.75  # [B]
    active[0] = True
    if batch > 3:
        active[-1] = False
    return logits, context, blocks, active


def _reference_mask(key: WatermarkKey, context: torch.Tensor, blocks: torch.Tensor, active: torch.Tensor, vocab: int):
    """bool [B, V] from the decoder's numpy shard function, one row at a time."""
    params = key.params
    tokens = np.arange(vocab, dtype=np.int64)
    rows = []
    for (c2, c1), value_row, on in zip(context.tolist(), blocks.numpy(), active.tolist(), strict=True):
        shards = shard(key.words, np.full(vocab, c2), np.full(vocab, c1), tokens, params.block_bits)  # [V, k]
        value = value_row[(c2 + c1) % params.num_blocks]
        boosted = shards[:, 0] == value if params.scheme == "mpac" else (shards != value).all(axis=1)
        rows.append(boosted & on)
    return torch.from_numpy(np.stack(rows))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize(
    ("d", "k", "scheme"),
    [
        (1, 1, "loso"),
        (2, 1, "loso"),
        (2, 2, "xmark"),
        (2, 3, "xmark"),
        (3, 2, "xmark"),
        (4, 2, "xmark"),
        (1, 4, "xmark"),
        (4, 8, "xmark"),
        (1, 1, "mpac"),
        (2, 1, "mpac"),
        (3, 1, "mpac"),
        (4, 1, "mpac"),
    ],
)
def test_boosted_fraction_matches_closed_form(d: int, k: int, scheme: Scheme) -> None:
    params = WatermarkParams(bits=8 * d, block_bits=d, num_keys=k, scheme=scheme)
    key = WatermarkKey.from_secret(SECRET, params)
    batch, vocab = 48, 8192
    logits, context, blocks, _ = _inputs(params, batch, vocab, seed=d * 100 + k)
    active = torch.ones(batch, dtype=torch.bool)
    out = TorchWatermarker(key).apply(logits, context, blocks, active)
    boosted = (out != logits).sum(dim=1).double()  # [B]
    q = 2.0**-d if scheme == "mpac" else (1 - 2.0**-d) ** k
    # per row ~ Binomial(V, q); over the batch ~ Binomial(B * V, q)
    total_sd = np.sqrt(batch * vocab * q * (1 - q))
    assert abs(boosted.sum().item() - batch * vocab * q) < 5 * total_sd
    row_sd = np.sqrt(vocab * q * (1 - q))
    assert ((boosted - vocab * q).abs() < 6 * row_sd).all(), boosted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "scheme"), [(2, "xmark"), (1, "loso"), (1, "mpac"), (3, "xmark")])
def test_bias_is_exactly_delta_on_the_decoders_boosted_tokens(dtype: torch.dtype, k: int, scheme: str) -> None:
    key = _key(bits=16, num_keys=k, scheme=scheme, delta=1.75)
    logits, context, blocks, active = _inputs(key.params, 12, 5000, seed=k, dtype=dtype)
    assert not active.all()
    before = logits.clone()
    out = TorchWatermarker(key).apply(logits, context, blocks, active)
    assert out.dtype == dtype and out.shape == logits.shape
    assert torch.equal(_bits(logits), _bits(before))  # input untouched
    mask = _reference_mask(key, context, blocks, active, 5000)
    assert mask.any(dim=1).sum() == active.sum()  # every active row has boosted tokens
    assert torch.equal(_bits(out[mask]), _bits(before[mask] + 1.75))
    assert torch.equal(_bits(out[~mask]), _bits(before[~mask]))
    if dtype == torch.float32:
        diff = (out.double() - before.double())[mask]
        assert torch.allclose(diff, torch.full_like(diff, 1.75), atol=1e-5)


def test_rows_with_different_messages_get_their_own_masks() -> None:
    key = _key()
    batch, vocab = 6, 4096
    logits = torch.zeros(batch, vocab)
    context = torch.tensor([[5, 9]] * batch)  # same context: any difference comes from the messages
    blocks = torch.stack([torch.full((8,), v % 4) for v in range(batch)])
    active = torch.ones(batch, dtype=torch.bool)
    out = apply_watermark(
        logits,
        context,
        blocks,
        active,
        words=torch.from_numpy(key.words.copy()),
        codes=TorchWatermarker(key).codes(torch.device("cpu"), vocab),
        params=key.params,
    )
    mask = out != 0
    assert torch.equal(mask, _reference_mask(key, context, blocks, active, vocab))
    assert torch.equal(mask[0], mask[4]) and torch.equal(mask[1], mask[5])  # same block value
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(mask[a], mask[b])


def test_inactive_rows_and_unboosted_tokens_are_bit_identical() -> None:
    key = _key()
    logits, context, blocks, active = _inputs(key.params, 8, 3000, seed=7)
    active[1::2] = False
    logits[:, :10] = float("-inf")  # tokens masked by an earlier processor stay masked
    out = TorchWatermarker(key).apply(logits, context, blocks, active)
    assert torch.equal(_bits(out[~active]), _bits(logits[~active]))
    assert torch.isneginf(out[:, :10]).all()


def test_inactive_rows_keep_signed_zeros() -> None:
    """'Untouched' means bit-identical: -0.0 logits of an unwatermarked row must stay -0.0."""
    key = _key()
    logits = torch.full((2, 256), -0.0)
    context = torch.tensor([[1, 2], [3, 4]])
    blocks = torch.zeros(2, 8, dtype=torch.int64)
    out = TorchWatermarker(key).apply(logits, context, blocks, torch.tensor([False, False]))
    assert torch.equal(_bits(out), _bits(logits))


def test_inplace_modifies_and_returns_the_input() -> None:
    key = _key()
    logits, context, blocks, active = _inputs(key.params, 4, 2048, seed=8)
    expected = TorchWatermarker(key).apply(logits, context, blocks, active)
    ctx_before, blocks_before, active_before = context.clone(), blocks.clone(), active.clone()
    out = TorchWatermarker(key).apply(logits, context, blocks, active, inplace=True)
    assert out.data_ptr() == logits.data_ptr()
    assert torch.equal(logits, expected)
    assert (
        torch.equal(context, ctx_before) and torch.equal(blocks, blocks_before) and torch.equal(active, active_before)
    )


def test_token_codes_cache_serves_any_width() -> None:
    key = _key()
    w = TorchWatermarker(key)
    for vocab in (100, 5000, 100, 4097):
        logits, context, blocks, active = _inputs(key.params, 4, vocab, seed=vocab)
        out = w.apply(logits, context, blocks, active)
        assert torch.equal(out != logits, _reference_mask(key, context, blocks, active, vocab))
    assert w.codes(torch.device("cpu"), 10).shape[1] >= 5000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype: torch.dtype) -> None:
    key = _key()
    logits, context, blocks, active = _inputs(key.params, 16, 49152, seed=9, dtype=dtype)
    cpu = TorchWatermarker(key).apply(logits, context, blocks, active)
    dev = torch.device("cuda")
    gpu = TorchWatermarker(key).apply(logits.to(dev), context.to(dev), blocks.to(dev), active.to(dev))
    assert gpu.device.type == "cuda"
    assert torch.equal(_bits(gpu.cpu()), _bits(cpu))


def _bad_call(key: WatermarkKey, **override: object) -> None:
    logits, context, blocks, active = _inputs(key.params, 4, 512, seed=10)
    w = TorchWatermarker(key)
    args = {
        "logits": logits,
        "context": context,
        "blocks": blocks,
        "active": active,
        "words": w.words(torch.device("cpu")),
        "codes": w.codes(torch.device("cpu"), 512),
        "params": key.params,
    }
    args.update(override)
    apply_watermark(args.pop("logits"), args.pop("context"), args.pop("blocks"), args.pop("active"), **args)


@pytest.mark.parametrize(
    ("override", "exc", "pattern"),
    [
        ({"logits": torch.zeros(512)}, TypeError, "logits"),
        ({"logits": torch.zeros(1, 4, 512)}, TypeError, "logits"),
        ({"logits": torch.zeros(4, 512, dtype=torch.int64)}, TypeError, "logits"),
        ({"context": torch.zeros(4, 2, dtype=torch.int32)}, TypeError, "context"),
        ({"context": torch.zeros(4, 3, dtype=torch.int64)}, TypeError, "context"),
        ({"context": torch.zeros(3, 2, dtype=torch.int64)}, TypeError, "context"),
        ({"blocks": torch.zeros(4, 7, dtype=torch.int64)}, TypeError, "blocks"),
        ({"blocks": torch.zeros(4, 8, dtype=torch.float32)}, TypeError, "blocks"),
        ({"active": torch.ones(4, dtype=torch.int64)}, TypeError, "active"),
        ({"active": torch.ones(5, dtype=torch.bool)}, TypeError, "active"),
        ({"codes": torch.ones(2, 100, dtype=torch.int64)}, ValueError, "codes"),
        ({"codes": torch.ones(3, 512, dtype=torch.int64)}, ValueError, "codes"),
    ],
)
def test_bad_shapes_and_dtypes_are_rejected(override: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        _bad_call(_key(), **override)


def test_wrap32_keeps_the_low_32_bits() -> None:
    from xmark_core.encoder import wrap32

    values = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 3 * 2**31 + 5, -1, -(2**31)], dtype=torch.int64)
    wrapped = wrap32(values)
    assert wrapped.dtype == torch.int32
    assert torch.equal(wrapped.to(torch.int64) & 0xFFFFFFFF, values & 0xFFFFFFFF)
    assert wrapped.tolist() == [0, 1, 2**31 - 1, -(2**31), -1, -(2**31) + 5, -1, -(2**31)]


SCHEMES_UNDER_TEST = [
    {"bits": 32, "num_keys": 4},
    {"bits": 16, "num_keys": 2},
    {"bits": 12, "block_bits": 3, "num_keys": 3},
    {"bits": 16, "block_bits": 4, "num_keys": 1, "scheme": "mpac"},
    {"bits": 8, "block_bits": 1, "num_keys": 1, "scheme": "loso"},
]


@pytest.mark.slow  # a statistical simulation: seconds on two cores
@pytest.mark.parametrize("native", [True, False], ids=["cpp-op", "compiled"])
@pytest.mark.parametrize(
    "settings",
    [*SCHEMES_UNDER_TEST, {"bits": 16, "num_keys": 8}],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()),
)
def test_fused_kernel_is_bit_identical_to_the_eager_op(settings: dict[str, Any], native: bool) -> None:
    """TorchWatermarker(compile=True) gives exactly the eager int64 op's logits, for several batch
    sizes, padded widths, float32 and bfloat16, every scheme and shard width, and a row whose context
    holds a negative id: float32 on the C++ op (xmark_core.cpu_op), bfloat16 (and float32 with
    ``native_on_cpu=False``) on the torch.compile'd kernel, both in 32-bit lanes."""
    from xmark_core import TorchWatermarker, WatermarkKey, WatermarkParams

    params = WatermarkParams(**settings)
    key = WatermarkKey.from_secret("fused-kernel-secret-0001", params)
    eager, fused = TorchWatermarker(key), TorchWatermarker(key, compile=True, native_on_cpu=native)
    codes = fused.codes32(torch.device("cpu"), 49160)
    assert codes.dtype == torch.int32 and bool((codes < 0).any()), "no code with the top bit set: a weak test"
    gen = torch.Generator().manual_seed(5)
    for batch, width in ((16, 49152), (3, 49160), (1, 1000)):
        logits = torch.randn(batch, width, generator=gen)
        context = torch.randint(0, width, (batch, 2), generator=gen)
        blocks = torch.randint(0, params.num_shards, (batch, params.num_blocks), generator=gen)
        active = torch.rand(batch, generator=gen) > 0.3
        active[0] = True
        context[0, 0] = -7  # the block index of a negative sum follows Python's modulo
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            expected = eager.apply(x, context, blocks, active)
            assert torch.equal(fused.apply(x, context, blocks, active), expected)
            inplace = x.clone()
            fused.apply(inplace, context, blocks, active, inplace=True)
            assert torch.equal(inplace, expected)
    assert fused.fused(torch.device("cpu")), "the fused kernel fell back to the eager op"
    assert fused.uses_cpp_op() is native, "the C++ op did not build here (a C++ compiler and ninja)"


@pytest.mark.slow  # compiles the kernel: seconds on two cores
def test_the_kernel_built_at_warm_up_serves_every_batch_without_recompiling() -> None:
    """vLLM samples under inference mode with a fresh [B, V] logits tensor (or a prefix view of a
    buffer) whose B changes step by step: after warm_up no step may build another kernel."""
    from torch._dynamo.utils import counters

    key = _key()
    fused = TorchWatermarker(key, compile=True)
    width = 49152
    fused.warm_up(torch.device("cpu"), width)
    graphs = counters["stats"]["unique_graphs"]
    eager = TorchWatermarker(key)
    with torch.inference_mode():
        buffer = torch.randn(96, width, generator=torch.Generator().manual_seed(96))  # seeded: the same logits
        for step, batch in enumerate((1, 2, 17, 64, 3, 96, 1, 40)):
            logits, context, blocks, active = _inputs(key.params, batch, width, seed=100 + step)
            expected = eager.apply(logits, context, blocks, active)
            fused.apply(logits, context, blocks, active, inplace=True)
            assert torch.equal(logits, expected)
            view = buffer[:batch]
            expected = eager.apply(view, context, blocks, active)
            fused.apply(view, context, blocks, active, inplace=True)
            assert torch.equal(view, expected)
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled another kernel"
    assert fused.fused(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernel_on_cuda_is_bit_identical_to_the_eager_op_on_cpu() -> None:
    """On a CUDA device the fused op is a generated GPU kernel; it must give exactly the CPU op's logits."""
    key = _key()
    eager, fused = TorchWatermarker(key), TorchWatermarker(key, compile=True)
    dev = torch.device("cuda")
    for batch, width, seed in ((16, 49152, 21), (5, 128256, 22), (1, 1000, 23)):
        logits, context, blocks, active = _inputs(key.params, batch, width, seed=seed)
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            expected = eager.apply(x, context, blocks, active)
            args = (context.to(dev), blocks.to(dev), active.to(dev))
            out = fused.apply(x.to(dev), *args)
            assert out.device.type == "cuda"
            assert torch.equal(out.cpu(), expected)
            inplace = x.to(dev)
            fused.apply(inplace, *args, inplace=True)
            assert torch.equal(inplace.cpu(), expected)
    assert fused._compiled is not None, "the fused kernel fell back to the eager op"


@pytest.mark.parametrize(
    ("options", "fused"),
    [({"compile": True}, True), ({"native_on_cpu": True}, False)],
    ids=["compile-falls-back-to-the-compiled-kernel", "native-falls-back-to-the-eager-op"],
)
def test_without_the_cpp_op_the_fallback_serves(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, bool], fused: bool
) -> None:
    """Where the C++ op cannot be built (no compiler or ninja), float32 CPU logits go to the
    torch.compile'd kernel with ``compile=True`` and to the eager op with ``native_on_cpu=True``
    alone, with the same logits; no bound step is offered."""
    from xmark_core import cpu_op

    monkeypatch.setattr(cpu_op, "load", lambda: None)
    key = _key()
    marker = TorchWatermarker(key, **options)
    logits, context, blocks, active = _inputs(key.params, 4, 1000, seed=3)
    expected = TorchWatermarker(key).apply(logits, context, blocks, active)
    assert torch.equal(marker.apply(logits, context, blocks, active), expected)
    assert not marker.uses_cpp_op()
    assert marker.fused(torch.device("cpu")) is fused
    assert marker.cpu_step(1000) is None


def test_cpp_op_without_compile_serves_float32_and_the_eager_op_the_rest() -> None:
    """``native_on_cpu=True`` (what the local backend builds) runs float32 CPU logits on the C++ op
    without torch.compile, bfloat16 on the eager op, both with the eager op's logits."""
    key = _key(bits=32, num_keys=4)
    marker, eager = TorchWatermarker(key, native_on_cpu=True), TorchWatermarker(key)
    assert marker.uses_cpp_op(), "the C++ op did not build here (a C++ compiler and ninja)"
    assert marker._compiled is None and marker._compiled32 is None  # nothing compiled at start-up
    for dtype in (torch.float32, torch.bfloat16):
        logits, context, blocks, active = _inputs(key.params, 6, 49152, seed=41, dtype=dtype)
        expected = eager.apply(logits, context, blocks, active)
        assert torch.equal(marker.apply(logits, context, blocks, active), expected)


def test_cpu_step_reads_the_first_rows_of_larger_buffers() -> None:
    """The bound step (the vLLM CPU worker's per-step call) on persistent buffers with more rows than
    the logits gives the eager op's logits for the first B rows, for the scheme of each kind."""
    for settings in ({"bits": 32, "num_keys": 4}, {"bits": 16, "scheme": "mpac", "num_keys": 1}):
        key = _key(**settings)
        marker = TorchWatermarker(key, compile=True)
        step = marker.cpu_step(49152)
        assert step is not None, "the C++ op did not build here (a C++ compiler and ninja)"
        logits, context, blocks, active = _inputs(key.params, 5, 49152, seed=47)
        expected = TorchWatermarker(key).apply(logits, context, blocks, active)
        extra = 3  # rows of the buffers past the batch, with values that would change the result
        big_context = torch.cat([context, torch.full((extra, 2), 11)])
        big_blocks = torch.cat([blocks, torch.zeros((extra, key.params.num_blocks), dtype=torch.int64)])
        big_active = torch.cat([active, torch.ones(extra, dtype=torch.bool)])
        out = logits.clone()
        step(out, big_context, big_blocks, big_active)
        assert torch.equal(out, expected)


def test_cpp_op_checks_its_operands() -> None:
    """The op reads raw pointers: a wrong type, a buffer shorter than the batch or codes narrower
    than the logits is refused with an error, never read past its end."""
    key = _key()
    step = TorchWatermarker(key, compile=True).cpu_step(1000)
    assert step is not None, "the C++ op did not build here (a C++ compiler and ninja)"
    logits, context, blocks, active = _inputs(key.params, 4, 1000, seed=53)
    bad = {
        "logits": (logits.to(torch.float64), context, blocks, active),
        "logits stride": (logits.t().contiguous().t(), context, blocks, active),
        "context": (logits, context.to(torch.int32), blocks, active),
        "context rows": (logits, context[:3], blocks, active),
        "blocks rows": (logits, context, blocks[:2], active),
        "active": (logits, context, blocks, active.to(torch.uint8)),
        "active rows": (logits, context, blocks, active[:1]),
        "codes width": (torch.randn(4, 1001), context, blocks, active),
    }
    for name, args in bad.items():
        before = args[0].clone()
        with pytest.raises(RuntimeError, match="must be"):
            step(*args)
        assert torch.equal(args[0], before), name


def _peaked(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits`` with a near-certain top token in ``rows`` (min-entropy far below 0.5 nats)."""
    out = logits.clone()
    out[rows, 7] = out[rows].amax(dim=1) + 25.0
    return out


def test_entropy_rule_leaves_confident_rows_alone_and_biases_the_others_as_without_it() -> None:
    """With min_entropy = h, a row whose min-entropy (logsumexp - max of its logits) is below h is
    bit-identical to its input, and every other row gets exactly the op's bias without the rule."""
    from xmark_core.gating import open_rows

    rule, plain = _key(bits=32, num_keys=4, min_entropy=0.5), _key(bits=32, num_keys=4)
    assert rule.fingerprint != plain.fingerprint  # the key version records the rule
    logits, context, blocks, active = _inputs(rule.params, 8, 4096, seed=61)
    logits = _peaked(logits, [0, 2, 5])
    entropy = torch.logsumexp(logits, 1) - logits.amax(1)
    assert bool((entropy[[0, 2, 5]] < 0.5).all()) and bool((entropy[[1, 3, 4, 6]] >= 0.5).all())
    assert torch.equal(open_rows(logits, 0.5), entropy >= 0.5)
    expected = apply_watermark(
        logits,
        context,
        blocks,
        active & (entropy >= 0.5),
        words=torch.tensor(plain.words.copy()),
        codes=TorchWatermarker(plain).codes(torch.device("cpu"), 4096),
        params=plain.params,
    )
    out = TorchWatermarker(rule).apply(logits, context, blocks, active)
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2, 5]], logits[[0, 2, 5]])
    changed = (out != logits).any(dim=1)
    assert bool(changed[[i for i in (1, 3, 4, 6) if bool(active[i])]].all())


@pytest.mark.slow  # builds the C++ op and compiles the kernel: seconds on two cores
def test_entropy_rule_is_the_same_on_every_encoder_path() -> None:
    """The eager op, the C++ op (called through apply and through the vLLM worker's bound step on
    larger buffers) and the compiled kernel (bfloat16) skip the same rows and agree bit for bit."""
    key = _key(bits=32, num_keys=4, min_entropy=0.3)
    eager = TorchWatermarker(key)
    native = TorchWatermarker(key, native_on_cpu=True)
    compiled = TorchWatermarker(key, compile=True, native_on_cpu=False)
    assert native.uses_cpp_op(), "the C++ op did not build here (a C++ compiler and ninja)"
    logits, context, blocks, active = _inputs(key.params, 6, 49152, seed=67)
    logits = _peaked(logits, [1, 4])
    expected = eager.apply(logits, context, blocks, active)
    assert torch.equal(expected[[1, 4]], logits[[1, 4]])
    assert torch.equal(native.apply(logits, context, blocks, active), expected)
    step = native.cpu_step(49152)
    assert step is not None
    out = logits.clone()
    extra = torch.ones(3, dtype=torch.bool)
    step(
        out,
        torch.cat([context, torch.zeros((3, 2), dtype=torch.int64)]),
        torch.cat([blocks, blocks[:3]]),
        torch.cat([active, extra]),
    )
    assert torch.equal(out, expected)
    half = logits.to(torch.bfloat16)
    assert torch.equal(compiled.apply(half, context, blocks, active), eager.apply(half, context, blocks, active))
    assert compiled.fused(torch.device("cpu"))
