"""The CPU watermark step as a C++ op, called like an eager torch op.

A vLLM CPU worker samples right after the model's forward pass, which leaves the caches cold. The
fused ``torch.compile`` kernel is fast over the logits, but calling a compiled function (its guards
and generated Python wrapper) costs about ten times more cold than warm; at small batches that call
is most of the step (``make bench-core``: ``compiled_call_ms_cold``). This op does the same work in
one C++ call: the context multipliers and block value of each row, then one pass over the logits in
32-bit lanes, bit-identical to :func:`xmark_core.encoder.apply_watermark` (tested).

It is built once per machine at first use (``torch.utils.cpp_extension``: a C++ compiler and
``ninja`` on PATH, which the ``ninja`` package installs next to the interpreter; cached under
``TORCH_EXTENSIONS_DIR``) for the CPU's vector width, and :func:`load` returns
None where it cannot be built, so callers keep the compiled kernel.

Processes that load it at once (a server's workers, a test run's) take turns on an ``flock`` of the
build directory, which the kernel releases when its holder dies, with a bounded wait. torch's own
build lock is a file that a killed build leaves behind, and torch then waits on it with no bound;
whoever holds the ``flock`` knows that file is stale, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .gating import gate
from .params import WatermarkParams

logger = logging.getLogger("xmark_core")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t kMask32 = 0xFFFFFFFFull;
constexpr uint64_t kMask31 = 0x7FFFFFFFull;
constexpr uint64_t kMul = 0x045D9F3Bull;

// xmark_core.hashing.mix32 on a value in [0, 2**32)
inline uint64_t mix32(uint64_t x) {
  x ^= x >> 16;
  x = (x * kMul) & kMask32;
  x ^= x >> 16;
  x = (x * kMul) & kMask32;
  x ^= x >> 16;
  return x;
}

// x + delta where boost is 1, x bit for bit where it is 0, as a select of the two values' bits. The
// plain `x[v] = boost ? x[v] + delta : x[v]` stores x[v] back unchanged where boost is 0, which the
// compiler turns into a conditional store; GCC vectorises that only as an AVX-512 masked store, so
// on AVX2 (or SSE) the loop runs scalar, tens of times slower (tests/core/test_encode_speed.py).
// This form stores every element and vectorises (compare, and-not, or) on every vector width.
inline float add_where(float x, float delta, uint32_t boost) {
  const float y = x + delta;
  uint32_t keep, add;
  std::memcpy(&keep, &x, sizeof keep);
  std::memcpy(&add, &y, sizeof add);
  const uint32_t mask = 0u - boost;  // all ones where boosted
  const uint32_t bits = (keep & ~mask) | (add & mask);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <int K>
void rows(float* logits, int64_t row_stride, int64_t begin, int64_t end, int64_t vocab,
          const int64_t* context, const int64_t* blocks, int64_t num_blocks, const bool* active,
          const int64_t* words, const int32_t* codes, int64_t code_stride, float delta, int shift,
          uint32_t low, bool match) {
  for (int64_t b = begin; b < end; ++b) {
    if (!active[b]) continue;
    const int64_t prev2 = context[2 * b], prev1 = context[2 * b + 1];
    int64_t index = (prev2 + prev1) % num_blocks;  // Python's modulo: never negative
    if (index < 0) index += num_blocks;
    const uint32_t value = static_cast<uint32_t>(blocks[b * num_blocks + index]);
    const uint64_t p2 = static_cast<uint64_t>(prev2) & kMask32, p1 = static_cast<uint64_t>(prev1) & kMask32;
    uint32_t multiplier[K];  // xmark_core.hashing.context_multipliers, < 2**31
    for (int j = 0; j < K; ++j) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(words + 5 * j);
      uint64_t h = mix32(w[0] ^ p2);
      h = mix32(h ^ w[1] ^ p1) ^ w[2];
      multiplier[j] = static_cast<uint32_t>((h & kMask31) | 1);
    }
    float* x = logits + b * row_stride;
    // one pass over the row in 32-bit lanes, branch-free (see add_where)
    if (match) {  // mpac: the token's shard is the block value
      for (int64_t v = 0; v < vocab; ++v) {
        uint32_t boost = 1;
        for (int j = 0; j < K; ++j)
          boost &= (((multiplier[j] * static_cast<uint32_t>(codes[j * code_stride + v])) >> shift) & low) == value;
        x[v] = add_where(x[v], delta, boost);
      }
    } else {  // xmark, loso: the token's shard differs from the block value under every key
      for (int64_t v = 0; v < vocab; ++v) {
        uint32_t boost = 1;
        for (int j = 0; j < K; ++j)
          boost &= (((multiplier[j] * static_cast<uint32_t>(codes[j * code_stride + v])) >> shift) & low) != value;
        x[v] = add_where(x[v], delta, boost);
      }
    }
  }
}

}  // namespace

void apply_(torch::Tensor logits, torch::Tensor context, torch::Tensor blocks, torch::Tensor active,
            torch::Tensor words, torch::Tensor codes32, double delta, int64_t block_bits, bool match) {
  // the op reads raw pointers: every operand's type and layout is checked here, so a caller may
  // hand it persistent buffers with more rows than the logits (it reads the first B)
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [B, V] with unit stride along V");
  const int64_t batch = logits.size(0), vocab = logits.size(1), k = codes32.size(0);
  TORCH_CHECK(context.dim() == 2 && context.scalar_type() == at::kLong && context.is_contiguous() &&
              context.size(0) >= batch && context.size(1) == 2, "context must be contiguous int64 [>= B, 2]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kLong && blocks.is_contiguous() &&
              blocks.size(0) >= batch && blocks.size(1) >= 1, "blocks must be contiguous int64 [>= B, r]");
  TORCH_CHECK(active.dim() == 1 && active.scalar_type() == at::kBool && active.is_contiguous() &&
              active.size(0) >= batch, "active must be contiguous bool [>= B]");
  TORCH_CHECK(codes32.dim() == 2 && codes32.scalar_type() == at::kInt && codes32.stride(1) == 1 &&
              codes32.size(1) >= vocab, "codes32 must be int32 [k, >= V] with unit stride along V");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kLong && words.is_contiguous() &&
              words.size(0) >= k && words.size(1) == 5, "words must be contiguous int64 [k, 5]");
  TORCH_CHECK(block_bits >= 1 && block_bits <= 4, "block_bits must be 1..4");
  float* x = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0), code_stride = codes32.stride(0), num_blocks = blocks.size(1);
  const int64_t* ctx = context.data_ptr<int64_t>();
  const int64_t* blk = blocks.data_ptr<int64_t>();
  const bool* act = active.data_ptr<bool>();
  const int64_t* w = words.data_ptr<int64_t>();
  const int32_t* c = codes32.data_ptr<int32_t>();
  const float d = static_cast<float>(delta);
  const int shift = static_cast<int>(32 - block_bits);
  const uint32_t low = (1u << block_bits) - 1u;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    switch (k) {
#define XMARK_CASE(K) \
      case K: \
        rows<K>(x, row_stride, begin, end, vocab, ctx, blk, num_blocks, act, w, c, code_stride, d, shift, low, \
                match); \
        break;
      XMARK_CASE(1) XMARK_CASE(2) XMARK_CASE(3) XMARK_CASE(4) XMARK_CASE(5) XMARK_CASE(6) XMARK_CASE(7) XMARK_CASE(8)
#undef XMARK_CASE
      default: TORCH_CHECK(false, "num_keys must be 1..8");
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("apply_", &apply_); }
"""

# the vector instructions the op is built for, by torch's own reading of the CPU (a build for one
# host's -march=native could fault on another that shares the cache directory)
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

_lock = threading.Lock()
_state: dict[str, Any] = {}


# how long a process waits for another one's build of the op before it serves without it; a build
# takes about a minute on 2 cores
DEFAULT_BUILD_WAIT_S = 600.0


def build_directory(name: str) -> str:
    """Where the op named ``name`` is built: torch's own choice (``TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions/py<version>_cpu``), created if missing."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


@contextlib.contextmanager
def build_turn(directory: str, timeout_s: float) -> Iterator[bool]:
    """This process's turn at building in ``directory``: yields True while it holds the directory's
    ``flock`` (released at exit, or by the kernel when the process dies), False when another holder
    kept it past ``timeout_s``."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "xmark.flock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def op_name() -> str:
    """The op's build name: the CPU's vector width and a digest of the source, the flags, torch's
    and Python's versions (a build for one of them is never loaded by another)."""
    capability = torch.backends.cpu.get_cpu_capability()
    identity = " ".join([_SOURCE, *_flags(capability), torch.__version__, sys.version])
    return f"xmark_cpu_op_{capability.lower()}_{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def _flags(capability: str) -> list[str]:
    return ["-O3", *_FLAGS.get(capability, [])]


def load(timeout_s: float = DEFAULT_BUILD_WAIT_S) -> Any | None:
    """The built op (a module with ``apply_``), or None where it cannot be built here or another
    process's build of it outlasts ``timeout_s``; built once per process (and per machine: later
    processes load the cached build)."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            from torch.utils.cpp_extension import load_inline

            name = op_name()
            directory = build_directory(name)
            with build_turn(directory, timeout_s) as held:
                if not held:
                    logger.warning(
                        "another process built the XMark C++ op for over %.0f s; the compiled kernel serves", timeout_s
                    )
                    return None  # not cached: a later call waits for the build again
                stale = os.path.join(directory, "lock")
                if os.path.exists(stale):  # torch's build lock with no build behind it: a killed build's
                    logger.warning("removed the build lock a stopped build of the XMark C++ op left in %s", directory)
                    os.remove(stale)
                module = load_inline(  # type: ignore[no-untyped-call]
                    name=name,
                    cpp_sources=_SOURCE,
                    extra_cflags=_flags(torch.backends.cpu.get_cpu_capability()),
                    build_directory=directory,
                    verbose=False,
                )
        except Exception as exc:  # no compiler or ninja here: the compiled kernel serves instead
            logger.warning("the XMark C++ op could not be built (%s); the compiled kernel serves", type(exc).__name__)
            module = None
        _state["module"] = module
        return module


def apply_(
    module: Any,
    logits: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    words: torch.Tensor,
    codes32: torch.Tensor,
    *,
    params: WatermarkParams,
) -> None:
    """``encoder._fused_apply32_`` as the C++ op ``module``: add ``params.delta`` in place to each
    active row's boosted tokens. ``logits``: float32 [B, V] with unit stride along V; the other
    operands contiguous, as :class:`~xmark_core.encoder.TorchWatermarker` holds them (``codes32``:
    int32 [k, >= V])."""
    module.apply_(
        logits, context, blocks, active, words, codes32, params.delta, params.block_bits, params.scheme == "mpac"
    )


# the op bound to one key's operands: step(logits, context, blocks, active), in place
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def bind(module: Any, words: torch.Tensor, codes32: torch.Tensor, *, params: WatermarkParams) -> Step:
    """:func:`apply_` with one key's operands bound: ``step(logits, context, blocks, active)``, one
    call into the op per decoding step with nothing else around it."""
    apply = module.apply_
    delta, block_bits, match = params.delta, params.block_bits, params.scheme == "mpac"
    if params.gated:  # the entropy rule: rows below the min-entropy threshold sit the step out

        def gated_step(logits: torch.Tensor, context: torch.Tensor, blocks: torch.Tensor, active: torch.Tensor) -> None:
            apply(logits, context, blocks, gate(logits, active, params), words, codes32, delta, block_bits, match)

        return gated_step

    def step(logits: torch.Tensor, context: torch.Tensor, blocks: torch.Tensor, active: torch.Tensor) -> None:
        apply(logits, context, blocks, active, words, codes32, delta, block_bits, match)

    return step
