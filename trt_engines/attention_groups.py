"""How a padded-attention engine splits one step's requests into SDPA calls (`TorchEngine`, and the step-time model
that predicts it).

One SDPA call over a batch pads every request to the call's most query rows and most keys. When one request sends a
deep draft tree and the rest send none, a single call makes every request compute the deep tree's rows: on the CPU a
batch-32 step with one 60-node tree cost 4.6x a plain step, where attending the deep tree on its own costs about one
extra request. So the batch is split into a few calls, each over requests of similar shape.

The split: sort requests by (query rows, keys), largest first, and cut the sorted order into at most `max_groups`
contiguous groups minimising the summed cost

    cost(group) = requests * keys_max * (rows_max + ROW_OFFSET) + CALL_COST

(dynamic programming over cut points). `ROW_OFFSET` is the per-request work that does not grow with query rows (the
K/V gather and the softmax pass over the keys), `CALL_COST` a call's fixed cost (launch, gather setup), both in units
of one query row over one key (per layer). Measured on this project's 2-core CPUs with SmolLM2's heads, bf16: a
request's attention at 600 keys cost ~70 us for 1 query row and ~800 us for 61 rows (~20 ns a unit), and every call
~140 us of host work before any (the K/V gather, query reorder, two matmuls, softmax and scatter are a dozen PyTorch
ops; timed once by forcing batches of one shape into 1, 2 and 4 calls, not kept in a results file).
`benchmarks/attention_calls.py` times verify steps of several batch, tree and context shapes under each candidate
CALL_COST, interleaved (`benchmarks/results/attention_calls.md`): 8192 was fastest or within 4% of the
fastest on every shape but plain batch 32 (10% behind 16384, which costs up to 11% elsewhere); the earlier 1024
(~15 us, the kernel launch alone) split too eagerly and ran 8-22% behind the fastest on six of the eight shapes.

On a CUDA GPU the same call is a dozen kernels launched from Python per layer, while the work it saves is tiny.
On an H100 with Llama-3.1-8B's shape each extra call cost 0.13-0.18 ms of host time per layer
(`attention_calls_cuda.md`: 2 or 3 calls against one, plain and tree batches of 16 and 32), while one unit (a query
row over a key, the key's K/V read from the pool) is about a nanosecond or less of the GPU's time. There
`CUDA_CALL_COST` prices a call at 2^19 units, so a step is split only where padding would cost the GPU more than
the host's launches (a 63-node tree beside 31 plain requests at 2k keys, not a few small trees among plain ones).
`call_cost_for(device)` gives an engine's price.

Example: rows [61, 1, 1, 1] at 600 keys each -> groups [[0], [1, 2, 3]]: 1*600*65 + 3*600*5 + 2*CALL_COST, against
4*600*65 + CALL_COST for one call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ROW_OFFSET = 4.0
CALL_COST = 8192.0
CUDA_CALL_COST = 2.0**19
MAX_GROUPS = 4


def call_cost_for(device_type: str) -> float:
    """The planner's price of one more attention call on an engine running on `device_type` ("cpu", "cuda")."""
    return CUDA_CALL_COST if device_type == "cuda" else CALL_COST


@njit(cache=True)
def _plan(rows: np.ndarray, keys: np.ndarray, max_groups: int, row_offset: float, call_cost: float) -> np.ndarray:
    """Group id (0 = first group) per position of the already sorted order (rows, keys descending)."""
    n = rows.shape[0]
    inf = np.inf
    # best[g, j]: cheapest split of the first j requests into g + 1 groups; cut[g, j]: where the last group starts
    best = np.full((max_groups, n + 1), inf)
    cut = np.zeros((max_groups, n + 1), np.int64)
    # cost of the group [i, j) is (j - i) * max(keys[i:j]) * (rows[i] + offset) + call_cost (rows sorted descending)
    for j in range(1, n + 1):
        kmax = 0
        for i in range(j - 1, -1, -1):
            kmax = max(kmax, keys[i])
            c = (j - i) * kmax * (rows[i] + row_offset) + call_cost
            if i == 0:
                if c < best[0, j]:
                    best[0, j] = c
                    cut[0, j] = 0
            else:
                for g in range(1, max_groups):
                    if best[g - 1, i] + c < best[g, j]:
                        best[g, j] = best[g - 1, i] + c
                        cut[g, j] = i
    g_best = 0
    for g in range(1, max_groups):
        if best[g, n] < best[g_best, n]:
            g_best = g
    group = np.empty(n, np.int64)
    j = n
    for g in range(g_best, -1, -1):
        i = cut[g, j]
        group[i:j] = g
        j = i
    return group


def plan_attention_groups(rows, keys, *, max_groups: int = MAX_GROUPS,
                          call_cost: float = CALL_COST) -> list[np.ndarray]:
    """Request indices per SDPA call, for requests with `rows[i]` query rows attending over `keys[i]` keys, a call
    priced at `call_cost` units (`call_cost_for`; inf: never split).

    Every request lands in exactly one group; a batch of equal shapes stays one call."""
    rows = np.asarray(rows, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    if rows.shape != keys.shape or rows.ndim != 1:
        raise ValueError(f"rows and keys must be 1-D and of one length; got {rows.shape} and {keys.shape}")
    n = rows.shape[0]
    if call_cost < 0 or np.isnan(call_cost):
        raise ValueError(f"call_cost must be a non-negative number of units (inf: one call); got {call_cost}")
    if n <= 1 or np.isinf(call_cost) or (rows.min() == rows.max() and keys.min() == keys.max()):
        return [np.arange(n)]
    order = np.lexsort((-keys, -rows))  # rows descending, then keys descending
    group = _plan(rows[order], keys[order], max(1, int(max_groups)), ROW_OFFSET, float(call_cost))
    return [order[group == g] for g in range(int(group.max()) + 1)]
