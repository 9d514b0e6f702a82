"""Bit-exact replicas of the random numbers V2's Triton kernels draw
(``vllm/v1/worker/gpu/sample/gumbel.py``: the murmur3 counter hash behind the Gumbel noise,
``spec_step_seed``, the draft-noise salt, and ``tl_rand32``, i.e. Triton's Philox
``tl.rand``), vectorized over tensors.

The arithmetic runs in NumPy on the tensors' memory (CPU tensors, shared, no copies):
NumPy has native wrapping ``uint32``/``uint64`` arithmetic (PyTorch lacks unsigned shifts
and adds, and emulating them in ``int64`` is several times slower, a multiplication of two
32-bit values overflowing it besides), and it is what Triton's interpreter computes with,
so the transcendental functions (``np.log``; ``torch.log`` differs in the last bit for
about a fifth of ``float32`` inputs) agree bit for bit with the interpreted kernels.

Large arrays are computed with explicit ``out=`` ufunc calls rather than operator
expressions: NumPy's elision of temporaries in expressions such as ``a * b + c`` checks
the C stack (``backtrace``) for each one above 256 KiB, which here costs a millisecond.

Arguments broadcast against each other; integers are taken as Triton takes them after the
kernels' casts (seeds and positions as ``int64``, hash offsets truncated to 32 bits).
Results are CPU tensors: hashes as ``int64`` in ``[0, 2**32)``, uniforms and noise as
``float32`` (``float64`` for the fp64 variants).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# gumbel.py's _DRAFT_NOISE_SALT: added to the position of a draft's Gumbel noise.
DRAFT_NOISE_SALT = 1 << 30
# gumbel.py's _TL_RAND_MIN: the smallest positive value of tl.rand (fp32).
TL_RAND_MIN = np.float32(4.6566127342e-10)
# Domain of murmur3_uniform64's second (high) hash.
UNIFORM64_DOMAIN = 0x9E3779B9

_U32 = np.uint32
_MASK32 = np.int64(0xFFFFFFFF)


def _np(x: Any, dtype: Any = None) -> np.ndarray:
    """``x`` (tensor, array or number) as a NumPy array of at least one dimension (ufuncs
    return scalars for 0-d arrays), sharing a CPU tensor's memory."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    x = np.atleast_1d(np.asarray(x))
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def _shape(*args: Any) -> tuple[int, ...]:
    """The broadcast shape of the arguments (their results' shape)."""
    return np.broadcast_shapes(*(tuple(a.shape) if hasattr(a, "shape") else np.shape(a)
                                 for a in args))


def _low32(x: np.ndarray) -> np.ndarray:
    """The low 32 bits of an integer array (Triton's ``.to(tl.uint32)``)."""
    if x.dtype in (np.int32, np.uint32):
        return x.view(_U32) if x.ndim else x.astype(_U32)
    return np.bitwise_and(x.astype(np.int64), _MASK32).astype(_U32)


def _high32(x: np.ndarray) -> np.ndarray:
    """Bits 32..63 of an ``int64`` (``((x >> 32) & 0xFFFFFFFF).to(tl.uint32)``)."""
    high = np.right_shift(x.astype(np.int64), np.int64(32))
    return np.bitwise_and(high, _MASK32).astype(_U32)


def _select(cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.where(cond, a, b)`` for same-shaped ``float32`` arrays, by bit masks (a
    sixth of np.where's time on unpredictable conditions; ``b`` is overwritten)."""
    mask = cond.view(np.uint8).astype(np.uint32)
    np.negative(mask, out=mask)  # all ones where cond
    a_bits, b_bits = a.view(np.uint32), b.view(np.uint32)
    out = np.bitwise_xor(a_bits, b_bits)
    np.bitwise_and(out, mask, out=out)
    np.bitwise_xor(out, b_bits, out=b_bits)
    return b


def _torch(x: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A result as a tensor of the arguments' broadcast ``shape``."""
    x = np.asarray(x).reshape(shape)
    return torch.from_numpy(x if x.flags.c_contiguous and x.flags.writeable else x.copy())


# ----------------------------------------------------------------------------- murmur3


def _scramble(key: np.ndarray) -> np.ndarray:
    """The key's part of murmur3's mix (independent of the running hash: a vocabulary's
    keys are scrambled once and shared by its rows)."""
    key = np.multiply(key, _U32(0xCC9E2D51))
    tmp = np.right_shift(key, _U32(17))
    np.left_shift(key, _U32(15), out=key)
    np.bitwise_or(key, tmp, out=key)
    np.multiply(key, _U32(0x1B873593), out=key)
    return key


def _mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    # In place on a fresh array from here on: the last mix and the finalizer run over
    # [rows, vocabulary], where temporaries cost as much as the arithmetic.
    h = np.bitwise_xor(h, _scramble(key))
    tmp = np.right_shift(h, _U32(19))
    np.left_shift(h, _U32(13), out=h)
    np.bitwise_or(h, tmp, out=h)
    np.multiply(h, _U32(5), out=h)
    np.add(h, _U32(0xE6546B64), out=h)
    return h


def _fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's finalizer, in place."""
    tmp = np.right_shift(h, _U32(16))
    np.bitwise_xor(h, tmp, out=h)
    np.multiply(h, _U32(0x85EBCA6B), out=h)
    np.right_shift(h, _U32(13), out=tmp)
    np.bitwise_xor(h, tmp, out=h)
    np.multiply(h, _U32(0xC2B2AE35), out=h)
    np.right_shift(h, _U32(16), out=tmp)
    np.bitwise_xor(h, tmp, out=h)
    return h


@np.errstate(over="ignore")  # (wrapping is the point; NumPy warns on 0-d operands)
def _hash32(seed: Any, pos: Any, offset: Any, domain: int = 0) -> np.ndarray:
    """murmur3_hash32 as a ``uint32`` array."""
    seed, pos = _np(seed, np.int64), _np(pos, np.int64)
    offset = _low32(_np(offset))
    # The prefix (seed, position) is mixed at its own shape, the offsets at theirs.
    h = np.full(np.broadcast_shapes(seed.shape, pos.shape), domain, dtype=_U32)
    h = _mix(h, _low32(seed))
    h = _mix(h, _high32(seed))
    h = _mix(h, _low32(pos))
    h = _mix(h, offset)
    np.bitwise_xor(h, _U32(16), out=h)
    return _fmix32(h)


def murmur3_hash32(seed: Any, pos: Any, offset: Any, domain: int = 0) -> torch.Tensor:
    """gumbel.py's ``murmur3_hash32(seed, pos, offset, domain)`` (``int64`` values of the
    ``uint32`` hash)."""
    return _torch(_hash32(seed, pos, offset, domain).astype(np.int64),
                  _shape(seed, pos, offset))


def _uniform32(random32: np.ndarray) -> np.ndarray:
    # (random32 + 0.5) * 2**-32, from the two exact 16-bit halves, rounded once in fp32.
    hi16 = np.right_shift(random32, _U32(16)).astype(np.float32)
    lo16 = np.bitwise_and(random32, _U32(0xFFFF)).astype(np.float32)
    np.multiply(hi16, np.float32(1.52587890625e-05), out=hi16)
    np.add(lo16, np.float32(0.5), out=lo16)
    np.multiply(lo16, np.float32(2.3283064365386963e-10), out=lo16)
    return np.add(hi16, lo16, out=hi16)


def murmur3_uniform32(seed: Any, pos: Any, offset: Any) -> torch.Tensor:
    """gumbel.py's ``murmur3_uniform32``: a ``float32`` uniform in (0, 1)."""
    return _torch(_uniform32(_hash32(seed, pos, offset)), _shape(seed, pos, offset))


def _uniform64(seed: Any, pos: Any, offset: Any) -> np.ndarray:
    lo = _hash32(seed, pos, offset).astype(np.uint64)
    random53 = _hash32(seed, pos, offset, domain=UNIFORM64_DOMAIN).astype(np.uint64)
    np.left_shift(random53, np.uint64(32), out=random53)
    np.bitwise_or(random53, lo, out=random53)
    np.right_shift(random53, np.uint64(11), out=random53)
    step = np.float64(1.1102230246251565e-16)  # 2**-53
    uniform = random53.astype(np.float64)
    np.add(uniform, np.float64(0.5), out=uniform)
    np.multiply(uniform, step, out=uniform)
    # The largest midpoint rounds to 1.0: kept open as the kernel does.
    one = np.equal(uniform, 1.0)
    if one.any():
        uniform[one] -= step
    return uniform


def murmur3_uniform64(seed: Any, pos: Any, offset: Any) -> torch.Tensor:
    """gumbel.py's ``murmur3_uniform64``: a ``float64`` uniform in (0, 1) from 53 bits."""
    return _torch(_uniform64(seed, pos, offset), _shape(seed, pos, offset))


# The series' Horner coefficients 1/7 .. 1/2 (after 1/8), rounded to fp32 as in the kernel.
_LOG1P_COEFFS = [np.float32(1.0 / k) for k in (7, 6, 5, 4, 3, 2)]


def _log1p_neg(value: np.ndarray) -> np.ndarray:
    value = np.asarray(value, dtype=np.float32)
    # Horner's steps c + value * p, in place (multiplication commutes bit for bit).
    series = np.multiply(value, np.float32(1.0 / 8.0))
    for coeff in _LOG1P_COEFFS:
        np.add(series, coeff, out=series)
        np.multiply(series, value, out=series)
    np.add(series, np.float32(1.0), out=series)
    np.multiply(series, value, out=series)
    np.negative(series, out=series)
    direct = np.subtract(np.float32(1.0), value)
    np.maximum(direct, np.float32(5.960464477539063e-08), out=direct)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.log(direct, out=direct)
    return _select(np.less(value, np.float32(0.25)), series, direct)


def log1p_neg_stable(value: Any) -> torch.Tensor:
    """gumbel.py's ``_log1p_neg_stable``: ``log(1 - value)`` for ``float32`` ``value`` in
    [0, 1), by a series below 0.25."""
    return _torch(_log1p_neg(_np(value, np.float32)), _shape(value))


def _gumbel(seed: Any, pos: Any, keys: Any, use_fp64: bool, is_drafting: bool) -> np.ndarray:
    pos = _np(pos, np.int64)
    if is_drafting:
        pos = np.add(pos, np.int64(DRAFT_NOISE_SALT))
    with np.errstate(divide="ignore", invalid="ignore"):
        if use_fp64:
            noise = np.log(_uniform64(seed, pos, keys))
        else:
            noise = _log1p_neg(_uniform32(_hash32(seed, pos, keys)))
        # -log(-x), in place
        np.negative(noise, out=noise)
        np.log(noise, out=noise)
        np.negative(noise, out=noise)
    return noise


# Elements of noise computed at once: a chunk's dozen temporaries stay in the caches
# (twice as fast over a large vocabulary as the whole [rows, vocabulary] at once).
_CHUNK = 1 << 17


def gumbel_noise(seed: Any, pos: Any, keys: Any, use_fp64: bool = False,
                 is_drafting: bool = False) -> torch.Tensor:
    """The Gumbel noise ``gumbel_noised_argmax`` adds to the logits of token ``keys`` at
    (``seed``, ``pos``): ``float32``, or ``float64`` with ``use_fp64``; the draft's
    stream (``pos`` salted) with ``is_drafting``."""
    shape = _shape(seed, pos, keys)
    keys = _np(keys)
    if len(shape) < 2 or keys.shape[-1] * 2 <= _CHUNK or keys.ndim != 1:
        return _torch(_gumbel(seed, pos, keys, use_fp64, is_drafting), shape)
    # Keys along the last axis, split in chunks of columns.
    out = np.empty(shape, dtype=np.float64 if use_fp64 else np.float32)
    step = max(1, _CHUNK // max(1, int(np.prod(shape[:-1]))))
    for start in range(0, shape[-1], step):
        out[..., start:start + step] = _gumbel(seed, pos, keys[start:start + step], use_fp64,
                                               is_drafting)
    return torch.from_numpy(out)


def spec_step_seed(seed: Any, step: Any) -> torch.Tensor:
    """gumbel.py's ``spec_step_seed``: ``step`` mixed into the high bits of ``seed``."""
    seed, step = _np(seed, np.int64), _np(step, np.int64)
    return _torch(seed ^ (step << np.int64(32)), _shape(seed, step))


# ------------------------------------------------------------------------ Philox (tl.rand)

_PHILOX_KEY_A, _PHILOX_KEY_B = _U32(0x9E3779B9), _U32(0xBB67AE85)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_ROUNDS = 10


def _mul_hi_lo(a: np.ndarray, b: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    product = a.astype(np.uint64) * b  # below 2**64: exact
    return (product >> np.uint64(32)).astype(_U32), (product & np.uint64(0xFFFFFFFF)).astype(
        _U32)


@np.errstate(over="ignore")
def _philox_randint(seed: Any, offset: Any, offset_64bit: bool | None = None) -> np.ndarray:
    """``tl.randint(seed, offset)``: the first word of Philox-4x32-10 with counter
    (offset low, offset high, 0, 0) and key (seed low, seed high), as ``uint32``."""
    raw = _np(offset)
    if offset_64bit is None:  # tl.randint takes the high word from 64-bit offsets only
        offset_64bit = raw.dtype.itemsize > 4
    seed = _np(seed, np.int64)
    c0 = _low32(raw)
    c1 = _high32(raw) if offset_64bit else np.zeros_like(c0)
    shape = np.broadcast_shapes(c0.shape, seed.shape)
    c0, c1 = np.broadcast_to(c0, shape), np.broadcast_to(c1, shape)
    c2 = c3 = np.zeros(shape, dtype=_U32)
    k0, k1 = np.broadcast_to(_low32(seed), shape), np.broadcast_to(_high32(seed), shape)
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = k0 + _PHILOX_KEY_A, k1 + _PHILOX_KEY_B
    return c0


def philox_randint(seed: Any, offset: Any, offset_64bit: bool | None = None
                   ) -> torch.Tensor:
    """Triton's ``tl.randint(seed, offset)`` (``int64`` values of its ``uint32``). The
    offset's high word counts only for 64-bit offsets (by default: a 64-bit dtype)."""
    return _torch(_philox_randint(seed, offset, offset_64bit).astype(np.int64),
                  _shape(seed, offset))


def _philox_rand(seed: Any, offset: Any, offset_64bit: bool | None = None) -> np.ndarray:
    x = _philox_randint(seed, offset, offset_64bit).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def philox_rand(seed: Any, offset: Any, offset_64bit: bool | None = None) -> torch.Tensor:
    """Triton's ``tl.rand(seed, offset)``: ``float32`` in [0, 1)."""
    return _torch(_philox_rand(seed, offset, offset_64bit), _shape(seed, offset))


def tl_rand32(seed: Any, offset: Any, includes_zero: bool,
              offset_64bit: bool | None = None) -> torch.Tensor:
    """gumbel.py's ``tl_rand32``: ``tl.rand``, kept off 0 unless ``includes_zero``."""
    u = _philox_rand(seed, offset, offset_64bit)
    return _torch(u if includes_zero else np.maximum(u, TL_RAND_MIN), _shape(seed, offset))
