r"""How close the serving decode step at block 16 is to the CPython floor of its work (issue 24,
docs/design.md §8): the serving loop's real step (``hcache.bench.host_serving``, block 16,
pool x1) timed interleaved, in one process, with an idealised step that does only the
operations such a step cannot avoid, on structures of the same sizes, with none of hcache's
checks, layers or generality.

The idealised step, per decode step of 256 requests of which ~16 open a block and ~16 close one:

- the 256 ids looked up in a dict; their lengths gathered, advanced, tested for a block boundary
  (NumPy, 256 rows); the token scattered into a ``[256, 2320]`` table; lengths, computed and
  pending counters scattered; the plan's offsets, live slots, tokens and block-table copy made;
- per opening row: the LRU leaf popped off an int heap, its hash dropped from the 37 136-entry
  hash map and the Mamba map, its parent's child count lowered (a parent left childless pushed
  as a leaf), its ref count, timestamp and hash written, the block written into the row's table;
- per closing row: one SHA-256 of the row's digest and the block's 128 bytes, the digest
  written back, the block linked to its parent (child count, parent id, hash, leaf flag), the
  row's hash and registered count written; as many more hash-map inserts and lookups (the
  prompt blocks an admission registers in the next commit); a Mamba-map lookup; two of the
  closing rows' 4-layer states copied into cache slots;
- the allocated blocks pushed back on the heap (to keep the structure's size steady).

Everything per item goes through memoryviews and Python ints, as hcache's few-item paths do.
It leaves out what hcache must also do (argument checks, distinct ids, parked rows, the
registration backlog, observers, the Mamba slot pool's LRU and the full commit rule), so its
time is a lower bound for any plain-Python step, fused or not.

``python bench/ab/decode_floor_inprocess.py [STEPS]`` prints one JSON line: both medians
(thread CPU time, µs) and their ratio floor / real.
"""

import gc
import hashlib
import heapq
import json
import random
import statistics
import sys
import time

import numpy as np

import hcache.bench.host_serving as host_serving

BATCH, ROW_TOKENS, ROW_BLOCKS, BLOCK, POOL, SLOTS = 256, 2320, 145, 16, 37_136, 1280
_LOW = (1 << 31) - 1


def _view(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B").cast(array.dtype.char)


class IdealDecodeStep:
    """The idealised block-16 decode step (see the module docstring), on seeded data."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        self.hash_map = {rng.getrandbits(62): b for b in range(POOL)}
        self.hash_of = list(self.hash_map)
        self.leaves = [(b << 31) | b for b in range(POOL)]     # timestamp << 31 | block
        self.clock = POOL
        self.mamba_map = {self.hash_of[rng.randrange(POOL)]: 1 for _ in range(SLOTS)}
        self.ids = [rng.getrandbits(40) for _ in range(BATCH)]
        self.row_of = {rid: row for row, rid in enumerate(self.ids)}
        self.tokens = np.zeros((BATCH, ROW_TOKENS), np.int64)
        self.token_bytes = memoryview(self.tokens).cast("B")
        self.lengths = np.array([rng.randrange(1, 2000) for _ in range(BATCH)], np.int64)
        self.pending = np.full(BATCH, -1, np.int64)
        self.computed = np.zeros(BATCH, np.int64)
        self.live_slots = np.arange(BATCH, dtype=np.int32)
        self.table = np.zeros((BATCH, ROW_BLOCKS), np.int32)
        self.table_cells = _view(self.table)
        self.digests = bytearray(32 * BATCH)
        self.row_hashes = _view(np.zeros((BATCH, ROW_BLOCKS), np.int64))
        self.held, self.registered = (_view(np.zeros(BATCH, np.int64)) for _ in range(2))
        self.refs = _view(np.zeros(POOL, np.int32))
        self.stamps, self.parents, self.hashes = (_view(np.zeros(POOL, np.int64))
                                                  for _ in range(3))
        self.children = _view(np.zeros(POOL, np.int32))
        self.is_leaf = memoryview(np.zeros(POOL, np.uint8))
        self.live = np.zeros((4, BATCH, 32), np.float32)
        self.cache = np.zeros((4, SLOTS, 32), np.float32)
        self.new_keys = [rng.getrandbits(62) for _ in range(1 << 16)]
        self.next_key = 0

    def step(self) -> np.ndarray:
        rows = np.fromiter(map(self.row_of.__getitem__, self.ids), np.int64, BATCH)
        starts = self.lengths[rows]
        ends = starts + 1
        if ends[ends.argmax()] > ROW_TOKENS - BLOCK:
            self.lengths[:] = 1     # (keeps the rows inside the table; rare)
            starts = self.lengths[rows]
            ends = starts + 1
        phase = starts % BLOCK
        opening = (phase == 0).nonzero()[0].tolist()
        closing = (phase == BLOCK - 1).nonzero()[0].tolist()
        new = self._allocate(len(opening))
        for row, block in zip(opening, new):
            n = self.held[row]
            self.table_cells[row * ROW_BLOCKS + n % ROW_BLOCKS] = block
            self.held[row] = n + 1
        self.tokens[rows, starts] = 7
        self.lengths[rows] = self.pending[rows] = ends
        plan = (np.arange(BATCH + 1), self.live_slots[rows], np.full(BATCH, 7).copy(),
                self.table.take(rows, axis=0))
        self.computed[rows] = ends      # the commit
        self.pending[rows] = -1
        self._register(closing)
        for block in new:
            self.clock += 1
            heapq.heappush(self.leaves, (self.clock << 31) | block)
        for row in closing:
            self.mamba_map.get(self.hash_of[row], -1)
        for row in closing[:2]:
            for layer in range(4):
                self.cache[layer, row] = self.live[layer, row]
        return plan

    def _allocate(self, n: int) -> list:
        new = []
        for _ in range(n):
            block = heapq.heappop(self.leaves) & _LOW
            h = self.hash_of[block]
            self.hash_map.pop(h, None)
            self.mamba_map.pop(h, None)
            parent = self.parents[block]
            left = self.children[parent] - 1
            self.children[parent] = left
            if not left:
                heapq.heappush(self.leaves, (self.clock << 31) | parent)
            self.refs[block], self.stamps[block], self.hashes[block] = 1, self.clock, -1
            new.append(block)
        return new

    def _register(self, closing: list) -> None:
        sha, digests, token_bytes = hashlib.sha256, self.digests, self.token_bytes
        for row in closing:
            at, start = 32 * row, row * ROW_TOKENS * 8
            digest = sha(digests[at:at + 32] + token_bytes[start:start + 8 * BLOCK]).digest()
            digests[at:at + 32] = digest
            block = self.table_cells[row * ROW_BLOCKS + 3]
            parent = self.table_cells[row * ROW_BLOCKS + 2]
            self.children[parent] += 1
            self.parents[block], self.hashes[block], self.is_leaf[parent] = parent, row, 0
            done = self.registered[row]
            self.row_hashes[row * ROW_BLOCKS + done % ROW_BLOCKS] = row
            self.registered[row] = done + 1
        keys, k = self.new_keys, self.next_key
        for i in range(2 * len(closing)):      # the step's decode blocks and a prompt's
            self.hash_map.setdefault(keys[k + i], i)
            self.hash_map.get(keys[k + i - 1], -1)
        self.next_key = (k + 64) % (len(keys) - 64)


class _Ctx:
    device, quick = "cpu", True


def main(steps: int) -> dict:
    server = host_serving._Server(_Ctx, BLOCK, 1, seed=BLOCK)
    for _ in range(300):
        server.step()
    ideal = IdealDecodeStep()
    for _ in range(50):
        ideal.step()
    clock, real, floor = time.thread_time_ns, [], []
    gc.disable()
    try:
        for _ in range(steps):
            real.append(server.step(clock)[0] / 1e3)
            t0 = clock()
            ideal.step()
            floor.append((clock() - t0) / 1e3)
    finally:
        gc.enable()
    real_median, floor_median = statistics.median(real), statistics.median(floor)
    return {"block": BLOCK, "steps": steps, "real_median": round(real_median, 1),
            "floor_median": round(floor_median, 1),
            "floor_over_real": round(floor_median / real_median, 3)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)))
