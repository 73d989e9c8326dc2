"""CPU model of bwd_wy.py's mbarrier protocol (no GPU): random interleavings of its three roles.

The consumers (WG0 + WG1, one actor: their 256 arrivals count as one), the producer warp and the
store warp run the kernel's sequence of waits / arrives / buffer reads and writes over the tiles of
one CTA (tile t = v-head t % G of item t // G). mbarriers as in ``ws_protocol`` (PTX parity
semantics, TMA landing at a random later time, 50x skewed role speeds). Checked on every
interleaving: no deadlock, every parity wait passes at its intended phase, every read sees the
tile it is meant for (the staged dv / dk included, which live in the producer's buffers).

``pair=False`` models the earlier dk hand-off (one dk_ready barrier, parity item % 2): it can be
lapped for G = 1, where every tile is an item.
"""

import random

from qlabench_tools.kernels.ws_protocol import Bar, run_programs

LOADS = ("k", "v", "dw", "du", "a", "g", "dgp")


def programs(ntiles, G, pair=True):
    cons, prod, store = [], [], []
    for t in range(ntiles):
        j, n, i, last = t % 2, t // 2, t // G, t % G == G - 1
        dk = (i % 2, (i // 2) % 2, i // 2 + 1) if pair else (0, i % 2, i + 1)  # (index, parity, phases done)
        prod += [("wait", "empty", j, 1 - n % 2, n), ("tma", j, t, LOADS + (("dkp",) if last else ())),
                 ("write", "b", j, t), ("arrive", "full", j)]  # fmt: skip
        cons += [("wait", "full", j, n % 2, n + 1)] + [("read", b, j, t) for b in LOADS + ("b",)]
        cons += [("write", "du", j, ("dv", t)), ("arrive", "dv_ready", j)]
        if last:
            cons += [("read", "dkp", j, t), ("write", "dkp", j, ("dk", t)), ("arrive", "dk_ready", dk[0])]
        cons += [("arrive", "empty", j)]
        store += [("wait", "dv_ready", j, n % 2, n + 1), ("read", "du", j, ("dv", t))]
        if last:
            store += [("wait", "dk_ready", dk[0], dk[1], dk[2]), ("read", "dkp", j, ("dk", t))]
        store += [("arrive", "empty", j)]
    return {"cons": cons, "prod": prod, "store": store}


def simulate(ntiles, G, seed, pair=True):
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in ("cons", "prod", "store", "tma")}
    bars = {"full": [Bar(1), Bar(1)], "empty": [Bar(2), Bar(2)], "dv_ready": [Bar(1), Bar(1)],
            "dk_ready": [Bar(1), Bar(1)] if pair else [Bar(1)]}  # fmt: skip
    return run_programs(programs(ntiles, G, pair), bars, speed, rng, bound=200000, tag=f" (G={G})")


def check(groups=(1, 2, 3, 4), items=(1, 2, 3, 5, 9), seeds=100, pair=True):
    for G in groups:
        for ni in items:
            for sd in range(seeds):
                simulate(ni * G, G, sd * 7919 + ni * 31 + G, pair)
    return True


if __name__ == "__main__":
    check()
    print("bwd_wy barrier protocol: OK (no deadlock, no parity aliasing, no buffer race) for G = 1..4")
