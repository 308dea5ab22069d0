"""Probe (2026-12-04, seventh session; kept in git history only): the mma.sync W4A16 tiles with x in
shared memory at batch 16 / 32 through quant_bench's sweep (its tile list patched in this process).
First call (92d822b): 8-warp tiles beside the defaults. Third call: x in a buffer a stage
(``x_stages = prefetch + 1``, one CTA barrier a pair) beside two stages of one buffer (two barriers).

    python3 benchmarks/w4a16_tiles_probe.py --batches 16,32 --shapes gate_up_fused,down --sweep --out t.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_bench  # noqa: E402

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402


def tiles(m: int) -> list:
    """The default, then 128 x BM x 4 warps with prefetch 1-3 and x_stages = prefetch + 1, then the two-stage
    (two barriers a pair) tile at prefetch 2 and 3; and 64-row tiles the same way."""
    bm = 16 if m <= 16 else 32
    T = g.GluonTiles
    return ([g.default_tiles(m, True)]
            + [T(bn, bm, 4, None, pf, True, None, x_stages=st, pdl=True) for bn in (128, 64)
               for pf, st in ((1, 2), (2, 3), (3, 4), (2, 2), (3, 2))])


quant_bench.sweep_tiles = tiles
sys.exit(quant_bench.main(sys.argv[1:]))
