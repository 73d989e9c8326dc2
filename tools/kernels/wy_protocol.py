"""CPU model of bwd_wy.py's mbarrier protocol (no GPU): random interleavings of its four roles.

Consumer 0 and consumer 1 (one warpgroup each, an actor whose 128 arrivals count as one), the
producer warp and the store warp run the kernel's sequence of waits / arrives / buffer reads and
writes over the items of one CTA: consumer w takes items 2m + w, one stage (w) each, its tile u =
m G + gi; the producer and the store warp walk the tiles in pair order (the kernel's
``pair_order``: v-head gi of item 2m, then of item 2m + 1). mbarriers as in ``ws_protocol`` (PTX parity semantics, TMA landing
at a random later time, 50x skewed role speeds). Checked on every interleaving: no deadlock, every
parity wait passes at its intended phase, every read sees the tile it is meant for (the staged dv
and dk included, which live in the producer's buffers of the stage: dv in dv_new's, dk in k's).

``mutate(progs)`` edits the programs before a run (a dropped wait must be caught).
"""

import random

from qlabench_kernels.bwd_wy import pair_order  # the kernel's tile order (plain integer arithmetic)
from ws_protocol import Bar, run_programs

LOADS = ("k", "v", "dw", "du", "a", "g", "dgp")


def programs(nitems, G):
    cons = {0: [], 1: []}
    prod, store = [], []
    npairs = (nitems + 1) // 2
    for s in range(npairs * 2 * G):
        m, gi, w = pair_order(s, G)
        if 2 * m + w >= nitems:
            continue
        u, last, tile = m * G + gi, gi == G - 1, (2 * m + w, gi)
        prod += [("wait", "empty", w, (u + 1) % 2, u), ("tma", w, tile, LOADS), ("write", "b", w, tile),
                 ("arrive", "full", w)]  # fmt: skip
        store += [("wait", "dv_ready", w, u % 2, u + 1), ("read", "du", w, ("dv", tile))]
        if last:
            store += [("wait", "dk_ready", w, m % 2, m + 1), ("read", "k", w, ("dk", tile))]
        store += [("arrive", "empty", w)]
    for w in (0, 1):
        n_w = (nitems - w + 1) // 2  # consumer w's items: 2m + w < nitems
        for u in range(n_w * G):
            m, gi = divmod(u, G)
            tile, last = (2 * m + w, gi), gi == G - 1
            c = cons[w]
            c += [("wait", "full", w, u % 2, u + 1)] + [("read", b, w, tile) for b in LOADS + ("b",)]
            c += [("write", "du", w, ("dv", tile)), ("arrive", "dv_ready", w)]
            c += [("read", "k", w, tile)]  # the dk GEMMs and the dg row sums read k after dv is staged
            if last:
                c += [("write", "k", w, ("dk", tile)), ("arrive", "dk_ready", w)]
            c += [("arrive", "empty", w)]
    return {"cons0": cons[0], "cons1": cons[1], "prod": prod, "store": store}


def simulate(nitems, G, seed, mutate=None):
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in ("cons0", "cons1", "prod", "store", "tma")}
    bars = {"full": [Bar(1), Bar(1)], "empty": [Bar(2), Bar(2)], "dv_ready": [Bar(1), Bar(1)],
            "dk_ready": [Bar(1), Bar(1)]}  # fmt: skip
    progs = programs(nitems, G)
    if mutate is not None:
        mutate(progs)
    return run_programs(progs, bars, speed, rng, bound=400000, tag=f" (G={G}, items={nitems})")


def check(groups=(1, 2, 3, 4), items=(1, 2, 3, 5, 9), seeds=100, mutate=None):
    for G in groups:
        for ni in items:
            for sd in range(seeds):
                simulate(ni, G, sd * 7919 + ni * 31 + G, mutate)
    return True


if __name__ == "__main__":
    check()
    print("bwd_wy barrier protocol: OK (no deadlock, no parity aliasing, no buffer race) for G = 1..4")
