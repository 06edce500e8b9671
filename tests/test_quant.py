"""QLoRA's quantized base (zoo/model/quant.py): NF4 bit for bit as bitsandbytes stores it, and a model that trains
its adapters on it exactly as on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest

from zoo.model import quant

# bitsandbytes' NF4 table, as published in the QLoRA paper's appendix / its CUDA kernel's dDequantizeNF4.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


def ref_nf4(x: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """bitsandbytes' NF4 written out plainly: (packed bytes, absmax per 64, dequantized values)."""
    x = np.asarray(x, np.float32).reshape(-1)
    thresholds = [np.float32((NF4[i] + NF4[i + 1]) / np.float32(2)) for i in range(15)]
    codes, absmaxes, values = [], [], []
    for start in range(0, x.size, 64):
        block = x[start:start + 64]
        amax = np.float32(np.max(np.abs(block)))
        absmaxes.append(amax)
        inv = np.float32(1.0) / max(amax, np.float32(1e-38))
        for v in block:
            s = np.float32(min(max(np.float32(v * inv), -1.0), 1.0))
            c = sum(1 for t in thresholds if s > t)  # on a threshold: the lower code
            codes.append(c)
            values.append(np.float32(NF4[c] * amax))
    if len(codes) % 2:
        codes.append(7)  # the padding value 0.0
    packed = bytes((codes[i] << 4) | codes[i + 1] for i in range(0, len(codes), 2))
    return packed, np.array(absmaxes, np.float32), np.array(values, np.float32)


def _hand_made(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if n >= 128:
        x[64:128] = 0.0  # an all-zero block
        x[0] = -0.0
    if n >= 256:
        # values exactly on the midpoints of a block whose absmax is 1: ties go to the lower code
        x[128:143] = [(NF4[i] + NF4[i + 1]) / np.float32(2) for i in range(15)]
        x[143] = 1.0
        x[144] = -0.0
    return x


def ref_dequantize(f, n: int) -> np.ndarray:
    """The n float32 values of NF4 fields (bitsandbytes' ``dequantize_4bit``: code * absmax, the absmax
    first rebuilt from its 8-bit codes under double quantization)."""
    codes = np.stack([f.packed >> 4, f.packed & 15], axis=-1).reshape(-1)[:n]
    absmax = f.absmax if f.absmax2 is None else (
        quant.DYNAMIC_CODE[f.absmax] * np.repeat(f.absmax2, 256)[:f.absmax.size] + np.float32(f.offset))
    return (NF4[codes] * np.repeat(absmax.astype(np.float32), 64)[:n]).astype(np.float32)


def dequantized(x: np.ndarray, double: bool = False) -> np.ndarray:
    """zoo.model.quant.dequantize of a flat vector quantized as one HF [1, n] matrix, flat."""
    return np.asarray(quant.dequantize(quant.quantize(x.reshape(-1, 1), 0, 1, double=double))).reshape(-1)


@pytest.mark.parametrize("n", [64, 63, 130, 4096 + 17, 200 * 64])
def test_nf4_matches_bitsandbytes_formula(n):
    x = _hand_made(n, n)
    packed, absmax, values = ref_nf4(x)
    got = quant.nf4_quantize(x)
    assert got.packed.tobytes() == packed
    assert np.array_equal(got.absmax, absmax)
    assert np.array_equal(dequantized(x).view(np.uint32), values.view(np.uint32))
    if n >= 128:
        assert got.packed[0] >> 4 == 7  # -0.0 quantizes as 0.0
        assert np.all(got.absmax[1] == 0) and packed[32:64] == bytes([0x77] * 32)  # zero block: code 7
    if n >= 256:
        assert got.packed[64] >> 4 == 0  # x[128], on the midpoint of codes 0 and 1: the lower
        assert (got.packed[72] >> 4) == 7  # x[144] = -0.0
    assert np.array_equal(quant.NF4_CODE, NF4)


def test_midpoint_ties_go_to_the_lower_code():
    x = np.zeros(64, np.float32)
    mids = [(NF4[i] + NF4[i + 1]) / np.float32(2) for i in range(15)]
    x[:15] = mids
    x[15] = 1.0
    codes = np.stack([quant.nf4_quantize(x).packed >> 4, quant.nf4_quantize(x).packed & 15], -1).reshape(-1)
    assert list(codes[:15]) == list(range(15)) and codes[15] == 15
    x[:15] = np.nextafter(np.array(mids, np.float32), np.float32(2))  # one ulp above: the upper code
    codes = np.stack([quant.nf4_quantize(x).packed >> 4, quant.nf4_quantize(x).packed & 15], -1).reshape(-1)
    assert list(codes[:15]) == list(range(1, 16))


def ref_double(absmax: np.ndarray, code: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Double quantization written out: absmax - mean, 8-bit nearest code (ties lower) per 256, absmax each."""
    offset = np.float32(absmax.mean(dtype=np.float32))
    centred = (absmax - offset).astype(np.float32)
    q, a2 = [], []
    for start in range(0, centred.size, 256):
        block = centred[start:start + 256]
        amax = np.float32(np.abs(block).max())
        a2.append(amax)
        inv = np.float32(1.0) / max(amax, np.float32(1e-38))
        for v in block:
            s = np.float32(v * inv)
            d = np.abs(code.astype(np.float64) - np.float64(s))
            q.append(int(np.flatnonzero(d == d.min())[0]))  # nearest; on a tie the lower
    return np.array(q, np.uint8), np.array(a2, np.float32), offset


@pytest.mark.parametrize("blocks", [1, 300, 777])
def test_double_quantization_matches_its_formula(blocks):
    x = (np.random.default_rng(blocks).standard_normal(blocks * 64 - 5) * 0.02).astype(np.float32)
    got = quant.nf4_quantize(x, double=True)
    plain = quant.nf4_quantize(x)
    q, a2, offset = ref_double(plain.absmax, quant.DYNAMIC_CODE)
    assert np.array_equal(got.absmax, q) and np.array_equal(got.absmax2, a2) and np.float32(got.offset) == offset
    assert got.packed.tobytes() == plain.packed.tobytes()
    want = (quant.DYNAMIC_CODE[q] * np.repeat(a2, 256)[:q.size] + offset).astype(np.float32)
    codes = np.stack([plain.packed >> 4, plain.packed & 15], axis=-1).reshape(-1)[:x.size]
    assert np.array_equal(dequantized(x, double=True), (NF4[codes] * np.repeat(want, 64)[:x.size]).astype(np.float32))


@pytest.mark.slow
def test_against_bitsandbytes_itself():
    """Slow (slow lane): an oracle run, bitsandbytes' own CPU kernels."""
    import bitsandbytes.functional as F  # in the test extra: a missing one fails here, loudly
    import torch
    assert np.array_equal(quant.DYNAMIC_CODE, F.create_dynamic_map(signed=True).numpy())
    assert np.array_equal(quant.NF4_CODE, F.get_4bit_type("nf4", device="cpu").numpy())
    rng = np.random.default_rng(0)
    for shape in [(64, 128), (7, 9), (300, 1000), (3, 21), (256, 4096)]:
        w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        w[0, :] = 0  # zero rows (an all-zero block when a row spans one)
        q, st = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4")
        ours = quant.nf4_quantize(w.reshape(-1))
        assert np.array_equal(q.numpy().reshape(-1), ours.packed), shape
        assert np.array_equal(st.absmax.numpy(), ours.absmax), shape
        assert np.array_equal(F.dequantize_4bit(q, st).numpy().reshape(-1), dequantized(w.reshape(-1)))
        q2, st2 = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4", compress_statistics=True)
        dq = quant.nf4_quantize(w.reshape(-1), double=True)
        assert np.array_equal(q2.numpy().reshape(-1), dq.packed)
        # offset: the float32 mean of the absmax, which torch sums in its own order: equal to within one ulp.
        assert abs(np.float32(st2.offset.item()) - np.float32(dq.offset)) <= np.spacing(np.float32(dq.offset))
        # The 8-bit stage, given the same offset: bitsandbytes' quantize_blockwise of (absmax - offset).
        centred = (ours.absmax - np.float32(dq.offset)).astype(np.float32)
        q8, st8 = F.quantize_blockwise(torch.from_numpy(centred), blocksize=256)
        assert np.array_equal(st8.absmax.numpy(), dq.absmax2)
        # bitsandbytes' CPU kernel searches its table approximately and, rarely, picks the code after the
        # nearest; ours is the nearest (its CUDA kernel's choice) wherever the two differ.
        theirs, mine = q8.numpy(), dq.absmax
        scaled = centred * (np.float32(1) / np.maximum(np.repeat(dq.absmax2, 256)[:centred.size], np.float32(1e-38)))
        code = quant.DYNAMIC_CODE
        for i in np.flatnonzero(theirs != mine):
            assert abs(code[mine[i]] - scaled[i]) < abs(code[theirs[i]] - scaled[i])
        if theirs.size >= 100:
            assert np.mean(theirs != mine) <= 0.02


def test_quantize_lays_out_each_matrix_as_hugging_face_does():
    """A zoo weight [layers, in, out] (or o's [layers, heads, head_dim, embed]) quantizes as the HF [out, in]."""
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((3, 4, 8, 40)) * 0.05).astype(np.float32)  # o: [L, heads, head_dim, embed]
    for double in (False, True):
        qw = quant.quantize(w, lead=1, contract=2, double=double)
        assert qw.lead == (3,) and qw.shape == (4, 8, 40)
        for layer in range(3):
            hf = w[layer].reshape(32, 40).T  # HF o_proj.weight [embed, heads * head_dim]
            f = quant.nf4_quantize(hf.reshape(-1), double)
            assert np.array_equal(np.asarray(qw.data["packed"][layer]), f.packed)
            want = ref_dequantize(f, hf.size).reshape(40, 32).T.reshape(4, 8, 40)
            assert np.array_equal(np.asarray(quant.dequantize(qw))[layer], want)
    q8 = quant.quantize(w, lead=1, contract=2, kind="int8")
    hf0 = w[0].reshape(32, 40).T
    amax = np.abs(hf0).max(1)
    assert np.array_equal(np.asarray(q8.data["q"][0]), np.round(hf0 * (np.float32(127) / amax)[:, None]).astype(np.int8))
    assert np.abs(np.asarray(quant.dequantize(q8)) - w).max() <= np.abs(w).max() / 127
    assert quant.dequantize(qw, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.slow
def test_nf4_double_quant_is_at_most_4_13_bits_per_parameter():
    from tests.quant_fixtures import random_params, tiny_config

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512)
    params = random_params(cfg)  # init_params's shapes, drawn with NumPy (jax.random compiles a kernel per shape)
    paths = quant.quantized_paths(cfg)

    def bits(double: bool) -> tuple[int, int]:  # (bytes, parameters) of the quantized projections
        qs = [quant.quantize(np.asarray(params[p]), *paths[p], "nf4", double) for p in paths]
        return sum(q.nbytes for q in qs), sum(int(np.prod(q.lead + q.shape)) for q in qs)

    nbytes, count = bits(double=True)
    assert count == sum(int(np.prod(params[p].shape)) for p in paths)
    assert 8 * nbytes / count <= 4.13, 8 * nbytes / count
    single = bits(double=False)
    assert 8 * single[0] / single[1] == pytest.approx(4.5, abs=0.01)  # 4 bits + a float32 per 64
