"""K-quant blocks (Q4_K, Q5_K, Q6_K) written with numpy: gguf-py reads these types but cannot write them, and no
package tunelab installs exposes llama.cpp's quantizer.

    quantize(values, ttype) -> uint8 [rows, bytes per row]        (values: float32 [rows, k * 256])

The layouts are ggml's (ggml-common.h: block_q4_K, block_q5_K, block_q6_K), super-blocks of 256 values:

    Q4_K  d f16 | dmin f16 | scales[12]: 8 six-bit scales, 8 six-bit mins | qs[128]: 4-bit q        144 bytes
    Q5_K  d f16 | dmin f16 | scales[12] | qh[32]: the fifth bits | qs[128]: the low 4 bits           176 bytes
    Q6_K  ql[128]: the low 4 bits | qh[64]: the high 2 bits | scales[16] int8 | d f16                210 bytes

    Q4_K / Q5_K: value = d * scale_s * q - dmin * min_s, sub-blocks s of 32, q in 0..15 / 0..31
    Q6_K:        value = d * scale_s * (q - 32),           sub-blocks s of 16, q in 0..63

The rounding is simpler than llama-quantize's (which searches each sub-block's scale and weighs by magnitude): a
sub-block's range sets its scale and minimum, those are rounded to 6 (Q6_K: 8) bits against the super-block's d,
then every value is rounded with the scale as stored. Readers decode the file the same either way; the export check
compares it with exactly these values (gguf-py dequantizes them) and with the model as trained.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256
TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
REFITS = 2  # least-squares passes over each sub-block's scale and minimum (Q4_K / Q5_K)


def quantize(values: np.ndarray, ttype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`values` [..., n * 256] as `ttype` blocks: uint8 [..., n * block bytes], as gguf.quants.quantize returns."""
    rows = np.ascontiguousarray(values, dtype=np.float32)
    if rows.shape[-1] % QK_K:
        raise ValueError(f"{ttype.name} needs rows of a multiple of {QK_K} values, not {rows.shape[-1]}")
    blocks = rows.reshape(-1, QK_K)
    if ttype == Q.Q6_K:
        packed = _q6_k(blocks)
    elif ttype in (Q.Q4_K, Q.Q5_K):
        packed = _q4_5_k(blocks, bits=4 if ttype == Q.Q4_K else 5)
    else:
        raise ValueError(f"not a k-quant tunelab writes: {ttype.name}")
    return packed.reshape(*rows.shape[:-1], -1)


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values as stored (float16) and as the reader sees them (float32 of that)."""
    half = values.astype(np.float16)
    return half, half.astype(np.float32)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros(np.broadcast_shapes(numerator.shape, denominator.shape),
                                                          dtype=np.float32), where=denominator != 0)


def _q4_5_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    top = (1 << bits) - 1
    x = blocks.reshape(-1, 8, 32)
    low = np.minimum(x.min(axis=-1), 0.0)  # the minimum is subtracted, so it is at most 0 (stored as -low >= 0)
    scales = (x.max(axis=-1) - low) / top
    mins = -low
    for _ in range(REFITS):  # least squares x ~ scale * q - min on the rounded q, the minimum kept >= 0
        q = np.clip(np.rint(_divide(x + mins[..., None], scales[..., None])), 0, top)
        n, sq, sx = q.shape[-1], q.sum(-1), x.sum(-1)
        det = n * (q * q).sum(-1) - sq * sq
        fit = _divide(n * (q * x).sum(-1) - sq * sx, det)
        fit_min = _divide(sq * (q * x).sum(-1) - (q * q).sum(-1) * sx, det)
        ok = (det > 0) & (fit > 0) & (fit_min >= 0)
        scales, mins = np.where(ok, fit, scales), np.where(ok, fit_min, mins)
    d_half, d = _f16(scales.max(axis=-1) / 63)
    dmin_half, dmin = _f16(mins.max(axis=-1) / 63)
    sc = np.clip(np.rint(_divide(scales, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_divide(x + offset, step)), 0, top).astype(np.uint8).reshape(-1, 4, 2, 32)
    # values 64j .. 64j+31 in the low nibbles of qs[32j ...], 64j+32 .. 64j+63 in the high ones
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    parts = [d_half.view(np.uint8).reshape(-1, 2), dmin_half.view(np.uint8).reshape(-1, 2), _pack_scales(sc, m)]
    if bits == 5:  # bit 2j of qh[l]: the fifth bit of value 64j + l; bit 2j + 1: of value 64j + 32 + l
        high = (q >> 4).astype(np.uint8)
        shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
        parts.append(np.bitwise_or.reduce(high << shifts[None, :, :, None], axis=(1, 2)).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins in 12 bytes, as ggml's get_scale_min_k4 unpacks them: bytes 0-3 hold scales 0-3
    (and the top 2 bits of scales 4-7), bytes 4-7 mins 0-3 (and the top bits of mins 4-7), bytes 8-11 the low
    4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(-1, 16, 16)
    # Each sub-block's largest magnitude maps to -32, the end of the range q - 32 in -32..31 reaches exactly.
    at = np.abs(x).argmax(axis=-1)
    peak = np.take_along_axis(x, at[..., None], axis=-1)[..., 0]
    scales = peak / -32
    d_half, d = _f16(np.abs(scales).max(axis=-1) / 127)
    sc = np.clip(np.rint(_divide(scales, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_divide(x, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # per half of 128 values: l in 0..31 of value groups 0..3 (l, l + 32, l + 64, l + 96)
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_half.view(np.uint8).reshape(-1, 2)], axis=1)
