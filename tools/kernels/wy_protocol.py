"""CPU model of bwd_wy.py's mbarrier protocol (no GPU): random interleavings of its four roles.

The chain warpgroup (WG0), the side warpgroup (WG1), the producer warp and the store warp run the
kernel's sequence of waits / arrives / buffer reads and writes over the tiles of one CTA (tile t =
v-head t % G of item t // G); a warpgroup's arrivals count as one. mbarriers as in ``ws_protocol``
(PTX parity semantics, TMA landing at a random later time, 50x skewed role speeds). A read stands at
the end of the span in which the kernel reads the buffer (just before the arrive that releases it).
Checked on every interleaving: no deadlock, every parity wait passes at its intended phase, every
read sees the tile it is meant for: the staged dv / dk (in the producer's du and dk-partial
buffers), WG0's per-stage zr / zc / diag, and its Σ dM⊙Γ of the item (one buffer, handed over by
dkk_ready / dkk_free).

``pair=False`` models the earlier dk hand-off (one dk_ready barrier, parity item % 2): it can be
lapped for G = 1, where every tile is an item.
"""

import random

from qlabench_tools.kernels.ws_protocol import Bar, run_programs

LOADS = ("k", "v", "dw", "du", "a", "g", "dgp")


def programs(ntiles, G, pair=True):
    chain, side, prod, store = [], [], [], []
    for t in range(ntiles):
        j, n, i, last = t % 2, t // 2, t // G, t % G == G - 1
        dk = (i % 2, (i // 2) % 2, i // 2 + 1) if pair else (0, i % 2, i + 1)  # (index, parity, phases done)
        full = ("wait", "full", j, n % 2, n + 1)
        prod += [("wait", "empty", j, 1 - n % 2, n), ("tma", j, t, LOADS + (("dkp",) if last else ())),
                 ("write", "b", j, t), ("arrive", "full", j)]  # fmt: skip
        chain += [full, ("read", "dw", j, t), ("read", "du", j, t), ("read", "v", j, t), ("arrive", "du_read", j),
                  ("write", "z", j, t), ("arrive", "z_ready", j)]  # fmt: skip
        if last:
            chain += ([("wait", "dkk_free", 0, (i - 1) % 2, i)] if i else []) + [
                ("write", "dkk", 0, i), ("arrive", "dkk_ready", 0)]  # fmt: skip
        chain += [("read", b, j, t) for b in ("k", "a", "g", "b")] + [("arrive", "empty", j)]
        side += [full, ("read", "a", j, t), ("read", "du", j, t), ("wait", "du_read", j, n % 2, n + 1),
                 ("write", "du", j, ("dv", t)), ("arrive", "dv_ready", j), ("read", "dw", j, t),
                 ("wait", "z_ready", j, n % 2, n + 1), ("read", "z", j, t)]  # fmt: skip
        if last:
            side += [("wait", "dkk_ready", 0, i % 2, i + 1), ("read", "dkk", 0, i), ("arrive", "dkk_free", 0),
                     ("read", "dkp", j, t), ("write", "dkp", j, ("dk", t)), ("arrive", "dk_ready", dk[0])]  # fmt: skip
        side += [("read", b, j, t) for b in ("k", "a", "g", "b", "dgp")] + [("arrive", "empty", j)]
        store += [("wait", "dv_ready", j, n % 2, n + 1), ("read", "du", j, ("dv", t))]
        if last:
            store += [("wait", "dk_ready", dk[0], dk[1], dk[2]), ("read", "dkp", j, ("dk", t))]
        store += [("arrive", "empty", j)]
    return {"chain": chain, "side": side, "prod": prod, "store": store}


def simulate(ntiles, G, seed, pair=True):
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in ("chain", "side", "prod", "store", "tma")}
    two = lambda: [Bar(1), Bar(1)]  # noqa: E731
    bars = {"full": two(), "empty": [Bar(3), Bar(3)], "dv_ready": two(), "du_read": two(), "z_ready": two(),
            "dk_ready": two() if pair else [Bar(1)], "dkk_ready": [Bar(1)], "dkk_free": [Bar(1)]}  # fmt: skip
    return run_programs(programs(ntiles, G, pair), bars, speed, rng, bound=400000, tag=f" (G={G})")


def check(groups=(1, 2, 3, 4), items=(1, 2, 3, 5, 9), seeds=100, pair=True):
    for G in groups:
        for ni in items:
            for sd in range(seeds):
                simulate(ni * G, G, sd * 7919 + ni * 31 + G, pair)
    return True


if __name__ == "__main__":
    check()
    print("bwd_wy barrier protocol: OK (no deadlock, no parity aliasing, no buffer race) for G = 1..4")
