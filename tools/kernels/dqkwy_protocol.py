"""CPU model of bwd_dqkwy.py's mbarrier protocol (no GPU): random interleavings of its three roles.

The consumers (WG0 + WG1, one actor: their 256 arrivals count as one), the producer warp and the
store warp run the kernel's sequence of waits / arrives / buffer reads and writes over the tiles of
one CTA (tile t = v-head t % G of item t // G). mbarriers as in ``ws_protocol`` (PTX parity
semantics, TMA landing at a random later time, 50x skewed role speeds); the five loads' full
barriers are ``full[0..4]`` = group A, dv_new, q, group V, k. Checked on every interleaving: no
deadlock, every parity wait passes at its intended phase, every read sees the tile (or item) it is
meant for: the one-slot buffers, g / β / the row table in slot t % 2, and the dv staged in v's buffer.
"""

import random

from qlabench_tools.kernels.ws_protocol import Bar, run_programs

A, U, Q, V, K = 0, 1, 2, 3, 4  # full[] indices (the TMA loads' barriers)


def programs(ntiles, G, drop=None):
    """The three roles' op lists; ``drop`` = (role, barrier, index) removes that role's waits on that
    barrier (a mutation check: each of them must then fail)."""
    cons, prod, store = [], [], []
    for t in range(ntiles):
        j, p, it, vi = t % 2, t % 2, t // G, t % G
        # producer: group A with g, β and the row table in slot j, then dv_new, q and k, group V
        prod += [("wait", "empty_a", 0, 1 - p, t), ("tma", A, t, ("do", "vn", "h", "dh", f"g{j}")),
                 ("write", f"b{j}", A, t), ("write", f"info{j}", A, t), ("arrive", "full", A),
                 ("wait", "empty_u", 0, 1 - p, t), ("tma", U, t, ("du",)), ("arrive", "full", U)]  # fmt: skip
        if vi == 0:
            prod += [("wait", "empty_q", 0, 1 - it % 2, it), ("tma", Q, it, ("q",)), ("arrive", "full", Q),
                     ("wait", "empty_k", 0, 1 - it % 2, it), ("tma", K, it, ("k",)), ("arrive", "full", K)]
        prod += [("wait", "empty_v", 0, 1 - p, t), ("tma", V, t, ("v", "a")), ("arrive", "full", V)]
        # consumers: phase A, then phase B
        cons += [("wait", "full", A, p, t + 1)] + [("read", b, A, t) for b in ("do", "vn", "h", "dh", f"g{j}", f"info{j}")]
        cons += [("wait", "full", Q, it % 2, it + 1)] if vi == 0 else []
        cons += [("read", "q", Q, it)] + ([("wait", "full", K, it % 2, it + 1)] if vi == 0 else [])
        cons += [("read", "k", K, it), ("wait", "full", U, p, t + 1), ("read", "du", U, t), ("read", "h", A, t),
                 ("arrive", "empty_a", 0), ("read", "q", Q, it), ("read", "k", K, it)]  # fmt: skip
        cons += [("arrive", "empty_q", 0)] if vi == G - 1 else []
        cons += [("wait", "full", V, p, t + 1), ("read", "v", V, t), ("read", "a", V, t), ("read", "du", U, t),
                 ("read", f"g{j}", A, t), ("read", f"b{j}", A, t), ("arrive", "empty_u", 0),
                 ("write", "v", V, ("dv", t)), ("arrive", "dv_ready", 0), ("read", "a", V, t),
                 ("read", f"b{j}", A, t), ("arrive", "empty_v", 0), ("read", "k", K, it), ("read", f"g{j}", A, t),
                 ("read", f"b{j}", A, t)]  # fmt: skip
        if vi == G - 1:
            cons += [("arrive", "empty_k", 0), ("read", f"info{j}", A, t)]
        # store warp: dv out of v's buffer
        store += [("wait", "dv_ready", 0, p, t + 1), ("read", "v", V, ("dv", t)), ("arrive", "empty_v", 0)]
    progs = {"cons": cons, "prod": prod, "store": store}
    if drop is not None:
        role, bar, idx = drop
        progs[role] = [op for op in progs[role] if not (op[0] == "wait" and op[1:3] == (bar, idx))]
    return progs


def simulate(ntiles, G, seed, drop=None):
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in ("cons", "prod", "store", "tma")}
    bars = {"full": [Bar(1) for _ in range(5)], "empty_a": [Bar(1)], "empty_u": [Bar(1)], "empty_q": [Bar(1)],
            "empty_k": [Bar(1)], "empty_v": [Bar(2)], "dv_ready": [Bar(1)]}  # fmt: skip
    return run_programs(programs(ntiles, G, drop), bars, speed, rng, bound=200000, tag=f" (G={G})")


def waits():
    """(role, barrier, index) of every wait of the protocol."""
    return sorted({(r, op[1], op[2]) for r, ops in programs(2, 2).items() for op in ops if op[0] == "wait"})


def check(groups=(1, 2, 3, 4), items=(1, 2, 3, 5, 9), seeds=100, drop=None):
    for G in groups:
        for ni in items:
            for sd in range(seeds):
                simulate(ni * G, G, sd * 7919 + ni * 31 + G, drop)
    return True


if __name__ == "__main__":
    check()
    print("bwd_dqkwy barrier protocol: OK (no deadlock, no parity aliasing, no buffer race) for G = 1..4")
