"""Probe (2026-12-04, seventh session; kept in git history only): the mma.sync W4A16 tiles with 8
warps (one 16-row step a warp at 128 output rows, two at 256) beside the defaults at batch 16 / 32,
through quant_bench's sweep (its tile list patched in this process).

    python3 benchmarks/w4a16_tiles_probe.py --batches 16,32 --shapes gate_up_fused,down --sweep --out t.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_bench  # noqa: E402

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402


def tiles(m: int) -> list:
    """The default, then 8-warp tiles of 128 and 256 rows (prefetch 1 / 2, stream-K / split-K), x in shared memory."""
    bm = 16 if m <= 16 else 32
    return [g.default_tiles(m, True)] + [g.GluonTiles(bn, bm, 8, None, pf, True, sp, pdl=True)
                                         for bn in (128, 256) for pf in (1, 2) for sp in (None, 0)]


quant_bench.sweep_tiles = tiles
sys.exit(quant_bench.main(sys.argv[1:]))
