"""Probe (history only): the W4A16 kernel with its W and x tiles loaded by TMA (host tensor
descriptors; OOB rows and K zero-filled), made from kvserve/kernels/triton_w4a16.py by text edits.
sm_90 compile (triton 3.6), 128 x 16 tile, two chunks a step: 96 registers (5 programs an SM),
4.1 lane-instructions a weight (the cp.async one_dot kernel: 127 and 3.2)."""
import importlib.util, os, sys
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kvserve", "kernels", "triton_w4a16.py")
CHUNK_TMA = '''
@triton.jit
def _chunk_tma(acc, w_desc, x_desc, s_rows, n0, m0, c, n_ok, BLOCK_N: tl.constexpr, DECODE: tl.constexpr):
    w = w_desc.load([n0, c * 16])
    sc = tl.load(s_rows + c, mask=n_ok, other=0)
    xt = x_desc.load([m0, c * 64])
    if DECODE == 1:
        w0, w1, w2, w3 = _decode_ptx(w, sc, _SCALES_BF16, _DECODE_BF16, tl.bfloat16, BLOCK_N)
    elif DECODE == 2:
        w0, w1, w2, w3 = _decode_ptx(w, sc, _SCALES_FP16, _DECODE_FP16, tl.float16, BLOCK_N)
    else:
        ty = tl.float32 if DECODE == 3 else xt.dtype
        w0 = _decode_twin(w, sc, 6, 15, 0, ty)
        w1 = _decode_twin(w, sc, 3, 12, 1, ty)
        w2 = _decode_twin(w, sc, 0, 13, 2, ty)
        w3 = _decode_twin(w, sc, 9, 14, 3, ty)
    wk = tl.reshape(tl.permute(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (0, 2, 3, 1)), (BLOCK_N, 64))
    return _mma(acc, wk, tl.trans(xt), DECODE == 3)

'''
def rep(s, a, b):
    assert s.count(a) == 1, a[:60]
    return s.replace(a, b)
def variant():
    s = open(SRC).read()
    s = rep(s, "@triton.jit(do_not_specialize=[\"M\", \"N\", \"K\", \"n_chunks\", \"tiles_n\", \"units\", \"programs\"])", CHUNK_TMA + "@triton.jit(do_not_specialize=[\"M\", \"N\", \"K\", \"n_chunks\", \"tiles_n\", \"units\", \"programs\"])")
    s = rep(s, "def _w4a16_kernel(\n    x_ptr, w_ptr, s_ptr,", "def _w4a16_kernel(\n    x_ptr, w_ptr, x_desc, w_desc, s_ptr,")
    s = rep(s, "            acc = _chunk(acc, w_rows, s_rows, x_cols, c, K, n_ok, m_ok, BLOCK_N, DECODE, EVEN_N, EVEN_K, ONE_DOT)\n        g = tl.load(g_ptr + rn, mask=n_ok, other=0.0)\n        y_at = y_ptr + rm",
            "            acc = _chunk_tma(acc, w_desc, x_desc, s_rows, (tile % tiles_n) * BLOCK_N, (tile // tiles_n) * BLOCK_M, c, n_ok, BLOCK_N, DECODE)\n        g = tl.load(g_ptr + rn, mask=n_ok, other=0.0)\n        y_at = y_ptr + rm")
    s = rep(s, "        return [x2, weight.codes, weight.scales.view(torch.int32),",
            "        from triton.tools.tensor_descriptor import TensorDescriptor\n        xd = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [t.block_m, 64])\n        wd = TensorDescriptor(weight.codes, list(weight.codes.shape), [weight.codes.stride(0), 1], [t.block_n, 16])\n        return [x2, weight.codes, xd, wd, weight.scales.view(torch.int32),")
    path = "/tmp/w4_tma.py"
    open(path, "w").write(s)
    spec = importlib.util.spec_from_file_location("w4_tma", path)
    m = sys.modules["w4_tma"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m
