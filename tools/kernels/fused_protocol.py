"""CPU model of fwd_fused.py's mbarrier protocol (no GPU): random interleavings of its roles.

Actors, with the threads each one arrives with: the state warpgroups wg0 and wg1 (128 each), aux
(WG2, 128), and the warps of WG3: warp 12 split into its elected lane w12e (1: expect_tx and the
TMA loads of Q, K, V) and its other lanes w12 (31), warp 13 (32: the gate tables gt) and warp 14
(32: a full chunk's o TMA-stored from q's slot once both halves are staged; modelled on every
chunk, a partial last chunk's rows being stored by the state warpgroups themselves).
Each actor runs the kernel's sequence of waits / arrives / buffer reads and writes; the barriers
have the kernel's counts, in threads (``COUNTS``), and ``ws_protocol.Bar``'s PTX parity semantics;
the state warpgroups' turns (named barriers 13 and 14, ``NAMED["turn"]``: warpgroup w's sync on its
own = an arrive and a wait, its arrive after a turn on the other's; warpgroup 1 arrives on warpgroup
0's once before its first turn and skips its arrive after its last) order warpgroup 1's O GEMM
(its read of Q) before warpgroup 0's staging of o over Q's slot, and the other way round.
Each TMA load (three per chunk) lands at a random later time; role speeds are skewed up to 250x.

Checked on every interleaving: no deadlock; every parity wait passes exactly at its intended phase
(no barrier lapped); every read of stage js = c % 3 (q, k, v, gt) or ring slot jt = c % 2 (ta, pp)
sees chunk c's data (no read before the write, no overwrite before the last reader is done; o's
halves o0 / o1 live in q's slot, so a Q read after either is written fails); every
barrier ends with its phase closed and no bytes in flight (the counts match the arrivals).
"""

import random

from qlabench_tools.kernels.ws_protocol import Bar, run_programs

COUNTS = {"full": 64, "empty": 416, "t_ready": 128, "t_free": 256, "o_staged": 256}
NAMED = {"turn": 256}  # index w: the barrier warpgroup w syncs on
NST = 3  # input stages; the aux -> state ring has 2
THREADS = {"wg0": 128, "wg1": 128, "aux": 128, "w12e": 1, "w12": 31, "w13": 32, "w14": 32}


def programs(nchunks):
    """Per actor: ("wait", bar, idx, parity, intended phases done) / ("arrive", bar, idx) /
    ("read" | "write", buf, slot, chunk) / ("tma", slot, chunk, (buf,))."""
    p = {r: [] for r in THREADS}
    p["wg1"] += [("arrive", "turn", 0)] if nchunks else []  # warpgroup 0 takes the first turn
    for c in range(nchunks):
        js, pj, jt, pt = c % NST, (c // NST) % 2, c % 2, (c // 2) % 2
        full, empty = ("wait", "full", js, pj, c // NST + 1), ("wait", "empty", js, 1 - pj, c // NST)
        slot = {"ta": jt, "pp": jt}
        # state, four turns: {X = Sᵀ Kᵀ, O = Sᵀ Qᵀ}, Vd = (Vᵀ − e^g⊙X) A_βᵀ (V read just before), O += Vd P, S += Vd' K;
        # the element passes between them read the gate tables
        turns = (("k", "q"), ("ta", "v"), ("pp",), ("k",))
        for h, wg in enumerate(("wg0", "wg1")):
            ops = [full, ("wait", "t_ready", jt, pt, c // 2 + 1)]
            for t, reads in enumerate(turns):
                n = 4 * c + t  # this warpgroup's turns before this one
                ops += [("arrive", "turn", h), ("wait", "turn", h, n % 2, n + 1)]
                ops += [("read", b, slot.get(b, js), c) for b in reads]
                if h == 0 or n < 4 * nchunks - 1:
                    ops.append(("arrive", "turn", 1 - h))
                ops += [("read", "gt", js, c)] if t < 3 else []
            # its half of o into q's slot js (q no longer holds chunk c's Q), staged for warp 14
            ops += [("arrive", "t_free", jt), ("write", "q", js, ("o", c)), ("write", f"o{h}", js, ("o", c)),
                    ("arrive", "o_staged", js), ("arrive", "empty", js)]  # fmt: skip
            p[wg] += ops
        p["w14"] += [("wait", "o_staged", js, pj, c // NST + 1), ("read", "o0", js, ("o", c)),
                     ("read", "o1", js, ("o", c)), ("arrive", "empty", js)]
        p["aux"] += [full, ("read", "k", js, c), ("read", "gt", js, c), ("wait", "t_free", jt, 1 - pt, c // 2),
                     ("read", "q", js, c), ("read", "k", js, c), ("read", "gt", js, c), ("write", "pp", jt, c),
                     ("read", "gt", js, c), ("write", "ta", jt, c), ("arrive", "t_ready", jt), ("arrive", "empty", js)]  # fmt: skip
        # Q's load lands on q and on the o halves staged in its slot
        p["w12e"] += [empty] + [("tma", js, c, b) for b in (("q", "o0", "o1"), ("k",), ("v",))] + [("arrive", "full", js)]
        p["w12"] += [empty, ("arrive", "full", js)]
        p["w13"] += [empty, ("write", "gt", js, c), ("arrive", "full", js)]
    return p


def simulate(nchunks, seed, mutate=None):
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in (*THREADS, "tma")}
    bars = {name: [Bar(n) for _ in range(NST if name in ("full", "empty", "o_staged") else 2)] for name, n in COUNTS.items()}
    bars.update({name: [Bar(n), Bar(n)] for name, n in NAMED.items()})
    progs = programs(nchunks)
    if mutate is not None:
        mutate(progs)
    run_programs(progs, bars, speed, rng, arrivals=THREADS)
    assert all(b.pending == b.count and b.tx == 0 for bs in bars.values() for b in bs), "phase left open"
    return True


def check(seeds=200, chunk_counts=range(1, 8), mutate=None):
    for nc in chunk_counts:
        for sd in range(seeds):
            simulate(nc, sd * 7919 + nc, mutate)
    return True


def drop_wait(role, bar, parity=None):
    """A mutation removing ``role``'s waits on ``bar`` (only those of ``parity`` when given; for
    tests: the model must fail)."""

    def mutate(progs):
        progs[role] = [op for op in progs[role] if not (op[0] == "wait" and op[1] == bar and parity in (None, op[3]))]

    return mutate


def waits():
    """Every (role, barrier) wait of the protocol."""
    return sorted({(r, op[1]) for r, ops in programs(NST).items() for op in ops if op[0] == "wait"})


if __name__ == "__main__":
    check()
    print("fwd_fused barrier protocol: OK (no deadlock, no parity aliasing, no buffer race)")
    for role, bar in waits():
        try:
            check(seeds=100, mutate=drop_wait(role, bar))
            print(f"  {role} without its {bar} wait: NOT caught")
        except AssertionError as e:
            print(f"  {role} without its {bar} wait: caught ({str(e)[:70]})")
