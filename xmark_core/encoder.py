"""The batched encoder op (torch): add delta to each watermarked row's boosted token list.

Shapes: logits [B, V] float32/float16/bfloat16 on any device; context [B, 2] int64 (x[t-2], x[t-1]);
blocks [B, r] int64 block values; active [B] bool. No Python loop over rows or vocabulary, no
host-device synchronisation: every step is a tensor op on the logits' device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from . import cpu_op, gumbel
from .errors import ArgumentError, ArgumentTypeError, ParamsError
from .gating import gate
from .hashing import MASK32, context_multipliers, token_codes, wrap32
from .keys import WatermarkKey
from .params import WatermarkParams


def boost_mask(
    context: torch.Tensor,
    blocks: torch.Tensor,
    words: torch.Tensor,
    codes: torch.Tensor,
    params: WatermarkParams,
    vocab_size: int,
) -> torch.Tensor:
    """bool [B, V]: True where the token is boosted for that row.

    xmark/loso: the evergreen list, i.e. tokens whose shard differs from the block value under
    every key; mpac: tokens whose shard equals the block value (one key).
    words: int64 [k, 5]; codes: int64 [k, >= V] token codes (see ``token_codes``).
    """
    r, d = params.num_blocks, params.block_bits
    prev2, prev1 = context[:, 0], context[:, 1]
    index = (prev2 + prev1) % r  # [B]
    value = blocks.gather(1, index[:, None])  # [B, 1]
    multipliers = context_multipliers(words, prev2, prev1)  # [B, k]
    shift = 32 - d
    buf = torch.empty((context.shape[0], vocab_size), dtype=torch.int64, device=context.device)
    mask: torch.Tensor | None = None
    for j in range(params.num_keys):
        torch.mul(multipliers[:, j : j + 1], codes[j, None, :vocab_size], out=buf)  # [B, V]
        buf.bitwise_and_(MASK32).bitwise_right_shift_(shift)  # shard under key j
        hit = buf == value if params.scheme == "mpac" else buf != value
        mask = hit if mask is None else mask.logical_and_(hit)
    assert mask is not None
    return mask


def apply_watermark(
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    *,
    words: torch.Tensor,
    codes: torch.Tensor,
    params: WatermarkParams,
    inplace: bool = False,
) -> torch.Tensor:
    """Return logits with delta added to every active row's boosted tokens (rows with active=False untouched)."""
    if params.distortion_free:
        raise ParamsError("scheme 'gumbel' samples instead of biasing: use TorchWatermarker.apply(..., temperature=)")
    _check(logits, context, blocks, active, codes, params)
    mask = boost_mask(context, blocks, words, codes, params, logits.shape[1])
    mask.logical_and_(gate(logits, active, params)[:, None])
    boosted = torch.where(mask, logits + params.delta, logits)  # untouched entries stay bit-identical
    return logits.copy_(boosted) if inplace else boosted


def _check(
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    codes: torch.Tensor,
    params: WatermarkParams,
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ArgumentTypeError(f"logits must be a floating [B, V] tensor (got {tuple(logits.shape)}, {logits.dtype})")
    batch, vocab = logits.shape
    if context.shape != (batch, 2) or context.dtype != torch.int64:
        raise ArgumentTypeError(f"context must be int64 [{batch}, 2] (got {tuple(context.shape)}, {context.dtype})")
    if blocks.shape != (batch, params.num_blocks) or blocks.dtype != torch.int64:
        raise ArgumentTypeError(
            f"blocks must be int64 [{batch}, {params.num_blocks}] (got {tuple(blocks.shape)}, {blocks.dtype})"
        )
    if active.shape != (batch,) or active.dtype != torch.bool:
        raise ArgumentTypeError(f"active must be bool [{batch}] (got {tuple(active.shape)}, {active.dtype})")
    if codes.dim() != 2 or codes.shape[0] != params.num_keys or codes.shape[1] < vocab:
        raise ArgumentError(f"codes must be int64 [{params.num_keys}, >= {vocab}] (got {tuple(codes.shape)})")


def _fused_apply(
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    words: torch.Tensor,
    codes: torch.Tensor,
    *,
    params: WatermarkParams,
) -> torch.Tensor:
    """The same computation as ``apply_watermark`` written as one expression chain, for torch.compile
    to fuse into a single pass over [B, V] (the eager version makes about ten passes)."""
    vocab = logits.shape[1]
    prev2, prev1 = context[:, 0], context[:, 1]
    value = blocks.gather(1, ((prev2 + prev1) % params.num_blocks)[:, None])  # [B, 1]
    multipliers = context_multipliers(words, prev2, prev1)  # [B, k]
    shift = 32 - params.block_bits
    mask = active[:, None]
    for j in range(params.num_keys):
        shard = ((multipliers[:, j : j + 1] * codes[j, None, :vocab]) & MASK32) >> shift  # [B, V]
        mask = mask & ((shard == value) if params.scheme == "mpac" else (shard != value))
    return torch.where(mask, logits + params.delta, logits)


def _fused_apply_(
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    words: torch.Tensor,
    codes: torch.Tensor,
    *,
    params: WatermarkParams,
) -> None:
    """``_fused_apply`` written back into ``logits``: compiled, the write is part of the same single
    pass (no [B, V] temporary, no second pass to copy it back)."""
    logits.copy_(_fused_apply(logits, context, blocks, active, words, codes, params=params))


def _fused_apply32_(
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    words: torch.Tensor,
    codes32: torch.Tensor,
    *,
    params: WatermarkParams,
) -> None:
    """``_fused_apply_`` in 32-bit lanes (the CPU kernel): a shard needs only the low 32 bits of
    multiplier x code, which an int32 product keeps (two's complement wraps modulo 2**32), so the
    [B, V] pass multiplies twice as many lanes per vector as in int64, and reads half the codes.
    The top d bits of the 32-bit product are ``(x >> (32 - d)) & (2**d - 1)`` (the shift of a
    signed int fills with the sign bit, which the mask drops). Bit-identical to the int64 op.

    Two things keep the [B, V] loop to vector arithmetic on every x86 vector width:

    * ``codes32`` is the int32 codes' bit pattern viewed as float32 and viewed back here (a
      bitcast, no conversion). The generated loop then reads them with the float vector load; on
      AVX2 (no AVX-512) ATen's int32 vector load of a counted block goes through a stack copy,
      which made the kernel about four times slower there.
    * the per-row operands (k context multipliers and the row's block value) are gathered into one
      small [B, k + 1] buffer first, so the loop reads them instead of recomputing the block index
      (a division) every eight tokens.
    """
    vocab = logits.shape[1]
    codes = codes32.view(torch.int32)  # [k, >= V]
    prev2, prev1 = context[:, 0], context[:, 1]
    value = blocks.gather(1, ((prev2 + prev1) % params.num_blocks)[:, None])  # [B, 1]
    multipliers = context_multipliers(words, prev2, prev1)  # [B, k], < 2**31
    k = params.num_keys
    row = torch.cat([multipliers, value], dim=1).to(torch.int32)  # [B, k + 1]
    value32 = row[:, k:]  # [B, 1]
    shift, low = 32 - params.block_bits, (1 << params.block_bits) - 1
    mask = active[:, None]
    for j in range(k):
        shard = ((row[:, j : j + 1] * codes[j, None, :vocab]) >> shift) & low  # [B, V] int32
        mask = mask & ((shard == value32) if params.scheme == "mpac" else (shard != value32))
    logits.copy_(torch.where(mask, logits + params.delta, logits))


class TorchWatermarker:
    """Device-side key material for one key version, with the token codes cached per device and width.

    Adapters (transformers, vLLM) hold one of these and call :meth:`apply` once per decoding step.
    With ``compile=True`` the op runs as one fused kernel built by ``torch.compile`` (C++ on CPU
    tensors, Triton on CUDA tensors; bit-identical to the eager op, in one pass over the [B, V]
    logits that writes them in place, instead of several passes and a copy); it is compiled once,
    on the first call (:meth:`warm_up` does that at start-up), and if compilation is unavailable
    the op falls back to the eager one. On the CPU, float32 logits go through a C++ op instead
    (``xmark_core.cpu_op``, the same single pass, built on first use): it is called like an eager op,
    without the compiled function's per-call cost, which dominates small batches when the model's
    forward pass has left the caches cold (``native_on_cpu=False`` keeps the compiled kernel).
    ``native_on_cpu=True`` uses the C++ op without ``compile`` too (the eager op serves where it
    cannot be built): what the local backend runs, as it needs no compilation at start-up.
    """

    def __init__(
        self,
        key: WatermarkKey,
        *,
        compile: bool = False,
        narrow_on_cpu: bool = True,
        native_on_cpu: bool | None = None,
    ) -> None:
        self.key = key
        # the CPU kernel in 32-bit lanes (False: the int64 kernel, for comparison in benchmarks)
        self._narrow_on_cpu = narrow_on_cpu
        # float32 CPU logits: the C++ op (xmark_core.cpu_op) where it builds, called without the
        # compiled function's per-call cost. None: with compile (False: the compiled kernel, for
        # comparison; True: also without compile, the eager op where it cannot be built)
        self._native_on_cpu = narrow_on_cpu and (compile if native_on_cpu is None else native_on_cpu)
        self._native: Any = None  # the built op, once loaded
        self.params = key.params
        self._words: dict[torch.device, torch.Tensor] = {}
        self._codes: dict[torch.device, torch.Tensor] = {}
        self._codes32: dict[torch.device, torch.Tensor] = {}
        self._compiled: Callable[..., None] | None = None
        self._compiled32: Callable[..., None] | None = None  # the CPU kernel, in 32-bit lanes
        self._compiled_sampler: Callable[..., None] | None = None  # scheme gumbel's op, fused
        if compile and self.params.distortion_free:
            sampler = partial(gumbel.sample_, num_blocks=self.params.num_blocks)
            self._compiled_sampler = torch.compile(sampler, dynamic=True)
        elif compile:
            self._compiled = torch.compile(partial(_fused_apply_, params=self.params), dynamic=True)
            self._compiled32 = torch.compile(partial(_fused_apply32_, params=self.params), dynamic=True)

    def warm_up(self, device: torch.device, width: int, *, inference_mode: bool = True) -> None:
        """Run the op once on dummy inputs so a fused kernel is compiled before the first request."""
        # Under the mode the caller samples in (vLLM: inference mode; transformers' generate:
        # no_grad): the grad and inference modes are among the compiled kernel's guards, and a
        # kernel built under another mode is rebuilt on the first step. Two sizes: batch 1 and a
        # dynamic-shape kernel for any larger batch. The write in place is what serving does.
        with torch.inference_mode() if inference_mode else torch.no_grad():
            for batch in (1, 2):
                logits = torch.zeros((batch, width), dtype=torch.float32, device=device)
                context = torch.zeros((batch, 2), dtype=torch.int64, device=device)
                blocks = torch.zeros((batch, self.params.num_blocks), dtype=torch.int64, device=device)
                active = torch.ones(batch, dtype=torch.bool, device=device)
                temperature = torch.ones(batch, dtype=torch.float32, device=device)
                self.apply(logits, context, blocks, active, inplace=True, temperature=temperature)

    def uses_cpp_op(self) -> bool:
        """Whether float32 CPU logits go through the C++ op (``xmark_core.cpu_op``; built on first use)."""
        return self._native_op() is not None

    def _native_op(self) -> Any:
        """The C++ op where this marker uses it and it builds here (built on first use), else None."""
        if not self._native_on_cpu:
            return None
        if self._native is None:
            self._native = cpu_op.load()
            if self._native is None:
                self._native_on_cpu = False
        return self._native

    def _apply_native(
        self,
        native: Any,
        logits: torch.Tensor,
        context: torch.Tensor,
        blocks: torch.Tensor,
        active: torch.Tensor,
        *,
        inplace: bool,
    ) -> torch.Tensor:
        device = logits.device
        codes = self.codes32(device, logits.shape[1])
        _check(logits, context, blocks, active, self.codes(device, logits.shape[1]), self.params)
        out = logits if inplace else logits.clone()
        cpu_op.apply_(
            native,
            out,
            context.contiguous(),
            blocks.contiguous(),
            active.contiguous(),
            self.words(device),
            codes,
            params=self.params,
        )
        return out

    def words(self, device: torch.device) -> torch.Tensor:
        words = self._words.get(device)
        if words is None:
            words = torch.tensor(self.key.words.copy(), dtype=torch.int64, device=device)
            self._words[device] = words
        return words

    def codes(self, device: torch.device, width: int) -> torch.Tensor:
        """int64 [k, >= width] token codes for token ids 0..width-1 (grown on demand, once per width)."""
        codes = self._codes.get(device)
        if codes is None or codes.shape[1] < width:
            tokens = torch.arange(width, dtype=torch.int64, device=device)
            codes = token_codes(self.words(device), tokens).T.contiguous()  # [k, width]
            self._codes[device] = codes
        return codes

    def cpu_step(self, width: int) -> cpu_op.Step | None:
        """The C++ op bound to this key's operands, for float32 CPU logits at most ``width`` wide, or
        None where this marker does not use it.

        ``step(logits, context, blocks, active)`` is :meth:`apply` with ``inplace=True`` and none of
        its Python-side work, for a caller that calls it every decoding step with its own buffers
        (the vLLM CPU worker): ``context`` int64 [>= B, 2], ``blocks`` int64 [>= B, r] and ``active``
        bool [>= B], contiguous; buffers with more rows than the logits are fine (the op reads the
        first B). The op checks every operand's type and layout itself.
        """
        native = self._native_op()
        if native is None or self.params.distortion_free:
            return None
        device = torch.device("cpu")
        return cpu_op.bind(native, self.words(device), self.codes32(device, width), params=self.params)

    def fused(self, device: torch.device) -> bool:
        """Whether :meth:`apply` on ``device`` runs the fused kernel (not the eager fallback)."""
        if device.type == "cpu" and self._narrow_on_cpu:
            return self._compiled32 is not None or self._native_op() is not None
        return device.type in ("cpu", "cuda") and self._compiled is not None

    def codes32(self, device: torch.device, width: int) -> torch.Tensor:
        """int32 [k, >= width]: :meth:`codes` wrapped to 32 bits (the CPU kernel's operands)."""
        codes = self._codes32.get(device)
        if codes is None or codes.shape[1] < width:
            codes = wrap32(self.codes(device, width))
            self._codes32[device] = codes
        return codes

    def codes32_bits(self, device: torch.device, width: int) -> torch.Tensor:
        """:meth:`codes32`'s bit pattern viewed as float32 [k, >= width] (what the CPU kernel reads)."""
        return self.codes32(device, width).view(torch.float32)

    def apply(
        self,
        logits: torch.Tensor,
        context: torch.Tensor,
        blocks: torch.Tensor,
        active: torch.Tensor,
        *,
        inplace: bool = False,
        temperature: torch.Tensor | None = None,
        truncation: gumbel.Truncation | None = None,
    ) -> torch.Tensor:
        """One decoding step: ``apply_watermark`` (biasing schemes) or, for scheme ``gumbel``, the
        keyed sampling of ``xmark_core.gumbel.sample_``, which needs each row's sampling
        ``temperature`` (float [B]; ignored by the biasing schemes, which act before it) and takes the
        rows' nucleus settings (``truncation``: top-k, top-p, min-p, applied before the choice)."""
        device = logits.device
        if self.params.distortion_free:
            if temperature is None or temperature.shape != logits.shape[:1]:
                raise ParamsError("scheme 'gumbel' needs each row's sampling temperature (a float [B] tensor)")
            _check(logits, context, blocks, active, self.codes(device, logits.shape[1]), self.params)
            out = logits if inplace else logits.clone()
            if truncation is not None:
                gumbel.truncate_(out, temperature, active, truncation)
            step = (out, temperature.to(device), context, blocks, active)
            words, width = self.words(device), logits.shape[1]
            if self._compiled_sampler is not None and device.type in ("cpu", "cuda"):
                # the fused CPU kernel reads the codes' bits as float32 (see _fused_apply32_)
                codes = self.codes32_bits(device, width) if device.type == "cpu" else self.codes32(device, width)
                try:
                    self._compiled_sampler(*step, words=words, codes=codes)
                except Exception as exc:  # no toolchain: keep serving, eagerly
                    warnings.warn(
                        f"fused sampling kernel unavailable, using the eager op ({type(exc).__name__})", stacklevel=2
                    )
                    self._compiled_sampler = None
                else:
                    return out
            gumbel.sample_(*step, words=words, codes=self.codes32(device, width), num_blocks=self.params.num_blocks)
            return out
        if self.params.gated and active.shape == logits.shape[:1]:
            # the entropy rule, once for every path below (the eager op's own gate then keeps these rows)
            active = gate(logits, active, self.params)
        if device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1:
            native = self._native_op()
            if native is not None:
                return self._apply_native(native, logits, context, blocks, active, inplace=inplace)
        # CPU: 32-bit lanes (bit-identical, tested); CUDA keeps the int64 kernel
        narrow = device.type == "cpu" and self._narrow_on_cpu
        kernel = self._compiled32 if narrow else self._compiled
        if kernel is not None and device.type in ("cpu", "cuda"):
            codes = self.codes(device, logits.shape[1])
            _check(logits, context, blocks, active, codes, self.params)
            out = logits if inplace else logits.clone()
            operands = self.codes32_bits(device, logits.shape[1]) if narrow else codes
            try:
                kernel(out, context, blocks, active, self.words(device), operands)
            except Exception as exc:  # no C++ toolchain, unsupported platform: keep serving, eagerly
                warnings.warn(
                    f"fused watermark kernel unavailable, using the eager op ({type(exc).__name__})", stacklevel=2
                )
                self._compiled = self._compiled32 = None
            else:
                return out
        return apply_watermark(
            logits,
            context,
            blocks,
            active,
            words=self.words(device),
            codes=self.codes(device, logits.shape[1]),
            params=self.params,
            inplace=inplace,
        )
