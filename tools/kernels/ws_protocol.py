"""CPU model of fwd_o.py's mbarrier protocol (no GPU): random interleavings of its three roles.

The state warpgroup, the producer warps 4 (TMA) and 5 (tables) and the store warp 6 (a full
chunk's o out of the stage's P buffer; modelled on every chunk) are one actor each, executing the
same sequence of waits / arrives / buffer reads and writes as the kernel (an actor's arrive = its
threads' arrivals, so barrier counts are in actors: full 2, empty 2, the others 1). mbarriers
follow PTX semantics: a phase completes when its pending count reaches 0 and its transaction bytes
have landed; ``wait(P)`` passes iff the current (incomplete) phase's parity differs from P. TMA
writes land at a random later time.
Each run draws a random speed per role (50x skews), so one role lagging far behind is exercised.

Checked on every interleaving: no deadlock; every parity wait passes exactly at the intended
phase (never a phase early or two late, i.e. no aliasing); every read of a shared buffer sees the
version written for its own chunk (no RAW or WAR race), including the TMA ring.
"""

import random


class Bar:
    def __init__(self, count):
        self.count, self.pending, self.done, self.tx = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the count in one phase"
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.done += 1
            self.pending = self.count

    def passes(self, parity):
        return self.done % 2 != parity


def programs(nchunks):
    """Per role: list of ops. ("wait", bar, idx, parity, intended_done) / ("arrive", bar, idx) /
    ("read", buf, slot, chunk) / ("write", buf, slot, chunk) / ("tma", bar, idx, bufs, chunk)."""
    state, prod, tab, st = [], [], [], []
    for c in range(nchunks):
        j, n = c % 2, c // 2
        # WG0: the state, the Q GEMM first (then Q's one buffer is free), the rest of the chunk
        state += [("wait", "full", j, n % 2, n + 1), ("wait", "q_full", 0, c % 2, c + 1),
                  ("read", "q", 0, c), ("arrive", "q_empty", 0),
                  ("read", "k", j, c), ("read", "g", j, c), ("read", "a", j, c), ("read", "v", j, c),
                  ("read", "p", j, c), ("write", "p", j, ("o", c)),  # o staged in P's buffer
                  ("arrive", "o_staged", j), ("arrive", "empty", j)]  # fmt: skip
        # warp 6: o out of the stage's P buffer, then its share of freeing the stage
        st += [("wait", "o_staged", j, n % 2, n + 1), ("read", "p", j, ("o", c)), ("arrive", "empty", j)]
        # warp 4: the stage's TMA loads, then Q's once the state is done with the previous Q
        prod += [("wait", "empty", j, 1 - n % 2, n), ("tma", "full", j, ("k", "v", "a", "p"), c), ("arrive", "full", j),
                 ("wait", "q_empty", 0, 1 - c % 2, c), ("tma", "q_full", 0, ("q",), c), ("arrive", "q_full", 0)]  # fmt: skip
        # warp 5: the per-token tables into the stage
        tab += [("wait", "empty", j, 1 - n % 2, n), ("write", "g", j, c), ("arrive", "full", j)]
    return {"state": state, "prod": prod, "tab": tab, "st": st}


def simulate(nchunks, seed, mutate=None):
    """One random interleaving; ``mutate(progs)`` may edit the programs (to test that bugs are caught)."""
    rng = random.Random(seed)
    speed = {r: rng.choice((0.02, 0.2, 1.0, 5.0)) for r in ("state", "prod", "tab", "st", "tma")}  # skewed roles
    bars = {"full": [Bar(2), Bar(2)], "empty": [Bar(2), Bar(2)], "o_staged": [Bar(1), Bar(1)], "q_full": [Bar(1)],
            "q_empty": [Bar(1)]}  # fmt: skip
    bufs = {}  # (buf, slot) -> chunk whose data it holds
    progs = programs(nchunks)
    if mutate is not None:
        mutate(progs)
    pc = {r: 0 for r in progs}
    in_flight = []  # TMA loads not yet landed: (bar, idx, bufs, chunk)
    steps = 0
    while True:
        steps += 1
        assert steps < 100000
        runnable = []
        for r, ops in progs.items():
            if pc[r] < len(ops):
                op = ops[pc[r]]
                if op[0] != "wait" or bars[op[1]][op[2]].passes(op[3]):
                    runnable.append(r)
        choices = runnable + (["tma"] if in_flight else [])
        if not choices:
            assert all(pc[r] == len(ops) for r, ops in progs.items()), f"deadlock at {pc}"
            return steps
        r = rng.choices(choices, weights=[speed[c] for c in choices])[0]
        if r == "tma":  # one in-flight TMA lands: writes its buffers, completes its tx bytes
            name, idx, names, c = in_flight.pop(rng.randrange(len(in_flight)))
            for b in names:
                bufs[(b, idx)] = c
            bar = bars[name][idx]
            bar.tx -= 1
            bar._maybe_complete()
            continue
        op = progs[r][pc[r]]
        pc[r] += 1
        kind = op[0]
        if kind == "wait":
            bar = bars[op[1]][op[2]]
            assert bar.done == op[4], f"{r}: {op} passed with {bar.done} phases done (intended {op[4]})"
        elif kind == "arrive":
            bars[op[1]][op[2]].arrive()
        elif kind == "write":
            bufs[(op[1], op[2])] = op[3]
        elif kind == "read":
            got = bufs.get((op[1], op[2]))
            assert got == op[3], f"{r}: reads {op[1]}[{op[2]}] for chunk {op[3]} but it holds chunk {got}"
        elif kind == "tma":
            bars[op[1]][op[2]].tx += 1  # expect_tx before the loads are issued
            in_flight.append(op[1:])


def run_programs(progs, bars, speed, rng, arrivals=None, bound=100000, tag=""):
    """Interleave per-actor op lists at random (weights ``speed``; "tma" = a load in flight lands)
    until every actor is done: ("wait", bar, idx, parity, intended phases done) must pass exactly at
    that phase; ("arrive", bar, idx) arrives ``arrivals[actor]`` times (1 by default);
    ("write" | "read", buf, slot, value) sets / checks what a buffer slot holds; ("tma", slot, value,
    bufs) adds expect_tx to full[slot], and the load, once landed, writes ``bufs`` of the slot and
    completes its bytes. A deadlock, a lapped wait or a stale read fails an assert (``tag`` in its
    message). The wy and fused protocol models run on it."""
    bufs, in_flight = {}, []
    pc = {r: 0 for r in progs}
    for _ in range(bound):
        runnable = [r for r, ops in progs.items() if pc[r] < len(ops)
                    and (ops[pc[r]][0] != "wait" or bars[ops[pc[r]][1]][ops[pc[r]][2]].passes(ops[pc[r]][3]))]  # fmt: skip
        choices = runnable + (["tma"] if in_flight else [])
        if not choices:
            assert all(pc[r] == len(ops) for r, ops in progs.items()), f"deadlock at {pc}{tag}"
            return True
        r = rng.choices(choices, weights=[speed[c] for c in choices])[0]
        if r == "tma":
            slot, value, names = in_flight.pop(rng.randrange(len(in_flight)))
            for b in names:
                bufs[(b, slot)] = value
            bars["full"][slot].tx -= 1
            bars["full"][slot]._maybe_complete()
            continue
        op = progs[r][pc[r]]
        pc[r] += 1
        if op[0] == "wait":
            done = bars[op[1]][op[2]].done
            assert done == op[4], f"{r}: {op} passed with {done} phases done (intended {op[4]}{tag})"
        elif op[0] == "arrive":
            for _ in range(1 if arrivals is None else arrivals[r]):
                bars[op[1]][op[2]].arrive()
        elif op[0] == "write":
            bufs[(op[1], op[2])] = op[3]
        elif op[0] == "read":
            got = bufs.get((op[1], op[2]))
            assert got == op[3], f"{r}: reads {op[1]}[{op[2]}] for {op[3]} but it holds {got}{tag}"
        elif op[0] == "tma":
            bars["full"][op[1]].tx += 1  # expect_tx, then the load is issued
            in_flight.append((op[1], op[2], op[3]))
    raise AssertionError("no progress bound reached")


def check(seeds=200, chunk_counts=(0, 1, 2, 3, 4, 5, 8, 13), mutate=None):
    for nc in chunk_counts:
        for sd in range(seeds):
            simulate(nc, sd * 7919 + nc, mutate)
    return True


def drop_ops(role, pred):
    """A mutation removing every op of ``role`` matching ``pred`` (for tests: the model must fail)."""

    def mutate(progs):
        progs[role] = [op for op in progs[role] if not pred(op)]

    return mutate


if __name__ == "__main__":
    check()
    print("fwd_o barrier protocol: OK (no deadlock, no parity aliasing, no buffer race)")
