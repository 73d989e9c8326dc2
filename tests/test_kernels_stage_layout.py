"""CPU test: fwd_o's C helpers that move a 64×64 bf16 tile between a wgmma accumulator fragment and
shared memory, modelled lane by lane.

``O_STAGE_SRC`` stores o's fragment transposed (stmatrix .x4.trans) and ``V_LOAD_SRC`` loads V's tile
transposed into the same fragment layout (ldmatrix .x4.trans): both must address TileLang's 128-byte
swizzle of the TMA tile (16-byte chunk c of row r at c ^ (r % 8)) and put register 4m + q of thread t
at the accumulator layout's pair 2n + h (``fwd_o.acc_layout``: V row 16·warp + 8h + lane / 4, tokens
8n + 2·(lane % 4) + {0, 1}). The address expressions are read from the C sources and evaluated here
(C and Python give ``* + >> & ^`` the same precedence).
"""

import re

import pytest
from qlabench_kernels import fwd_o

ADDR = re.compile(r"__cvta_generic_to_shared\(half \+ (.+?)\)\)\)")


def _addr_expr(src):
    (expr,) = ADDR.findall(src)
    return expr


def _swizzled(row, col):
    """Element offset of (row, col) of a [64, 64] bf16 tile under the 128-byte swizzle."""
    return row * 64 + ((col // 8) ^ (row % 8)) * 8 + col % 8


def _fragment_coords(t, reg):
    """(V row, first token) of 32-bit register ``reg`` of warpgroup thread ``t`` in the accumulator layout."""
    lane, warp = t % 32, (t // 32) % 4
    n, h = reg // 2, reg % 2
    return 16 * warp + 8 * h + lane // 4, 8 * n + 2 * (lane % 4)


def _lane_addresses(expr, warp, m):
    """Per lane of one warp, the element offset it passes for step m (``half`` excluded)."""
    out = []
    for lane in range(32):
        t = 32 * warp + lane
        q, r = (t & 31) >> 3, t & 7
        out.append(eval(expr, {}, {"t": t, "q": q, "r": r, "m": m}))  # noqa: S307 - the kernel's own expression
    return out


def test_load_and_store_use_one_address_map():
    assert _addr_expr(fwd_o.V_LOAD_SRC) == _addr_expr(fwd_o.O_STAGE_SRC)
    for src in (fwd_o.V_LOAD_SRC, fwd_o.O_STAGE_SRC):
        assert "((t >> 7) & 1) * 4096" in src  # each warpgroup its own 64-column half of the tile
        assert re.search(r"v\[4 \* m\].*v\[4 \* m \+ 1\].*v\[4 \* m \+ 2\].*v\[4 \* m \+ 3\]", src, re.S)


@pytest.mark.parametrize("warp", range(4))
def test_ldmatrix_trans_delivers_v_transposed_in_the_accumulator_layout(warp):
    """ldmatrix .x4.trans: matrix k's eight rows are 16-byte vectors at the addresses of lanes 8k..8k+7;
    lane L receives row-pair elements (2(L % 4), L / 4) and (2(L % 4) + 1, L / 4) of it. With the tile
    holding V[token, v], register 4m + k of thread t must hold Vᵀ at the accumulator layout's place."""
    tile = {}
    for tok in range(64):
        for v in range(64):
            tile[_swizzled(tok, v)] = (tok, v)
    expr = _addr_expr(fwd_o.V_LOAD_SRC)
    for m in range(4):
        addr = _lane_addresses(expr, warp, m)
        for k in range(4):
            rows = [[tile[addr[8 * k + r] + c] for c in range(8)] for r in range(8)]
            for lane in range(32):
                got = (rows[2 * (lane % 4)][lane // 4], rows[2 * (lane % 4) + 1][lane // 4])
                vrow, tok = _fragment_coords(32 * warp + lane, 4 * m + k)
                assert got == ((tok, vrow), (tok + 1, vrow)), (m, k, lane)


def test_every_tile_element_is_read_once():
    expr = _addr_expr(fwd_o.V_LOAD_SRC)
    seen = []
    for warp in range(4):
        for m in range(4):
            for a in _lane_addresses(expr, warp, m):
                assert a % 8 == 0  # 16-byte aligned vectors
                seen += range(a, a + 8)
    assert sorted(seen) == list(range(64 * 64))
