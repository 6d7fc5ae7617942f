"""How the CUDA runner shapes its calls: buckets of rows and tokens, and a prefill call's plan
(which new rows' first tokens take a gemv decode step, which path the rest takes). Pure Python,
no GPU: cuda_runner.py runs what this decides.

A decode step runs in the graph of its batch's bucket (`buckets`: powers of 2). A prefill call is
padded to `call_shape` (rows on the scratch slot), so that every call of the same buckets replays
one CUDA graph whatever its rows' lengths; `shape_key` is what its graph and its kernels'
variants follow, and `warm_up_calls` meets each of those once.
"""

from __future__ import annotations

from collections.abc import Sequence

AUTO_PATH_MAX = 64  # the gemv path serves at most this many rows (one block of rows)
# Prefills of up to this many tokens (padded: call_shape) take the gemv path (fp32 activations, the
# recurrent kernel); more, the large path. H200, one row, graphs (docs/gpu.md): the gemv path
# costs about 0.07 ms a token at 1.5B (0.23 at 7.2B), the large path about 2.2-2.6 ms for 8-128
# tokens (5.6-7.6 at 7.2B) plus a new row's first-token step; 16 tokens of a new row 2.67 against
# 3.11 ms, 32 tokens 4.54 against 3.25.
EXACT_PREFILL = 16


def row_bucket(n: int) -> int:
    """Rows are padded to a power of 2 (a decode graph's bucket, a prefill call's rows)."""
    return 1 << (n - 1).bit_length()


def token_bucket(n: int) -> int:
    """A prefill call's tokens are padded to a power of 2 up to 128, then to a multiple of 64, and
    from 512 up to a quarter of the power of 2 below (at most 25% more, mostly less): 640, 768,
    896, 1024, 1280, ..., 4096, 5120, ... The large path's products cost little more for a few more
    tokens, and a shape that recurs replays a graph."""
    if n <= 128:
        return row_bucket(n)
    step = max(64, 1 << (n.bit_length() - 3))
    return -(-n // step) * step


def call_shape(rows: int, tokens: int) -> tuple[int, int]:
    """The (rows, tokens) a prefill call is padded to: its buckets, with at least one more row
    (of at least a token each) where the call does not already fill both."""
    R, T = row_bucket(rows), token_bucket(tokens)
    if (R, T) == (rows, tokens):
        return R, T
    if R == rows:
        R *= 2
    return R, token_bucket(tokens + R - rows)


def plan(lengths: Sequence[int], fresh: Sequence[bool]) -> tuple[list[list[int]], list[int]]:
    """How prefill runs rows of these lengths, `fresh` those from the zero state: groups of new rows
    (at most AUTO_PATH_MAX a group) whose first tokens take a gemv decode step first, then the rows
    that go on in the call (a new row's without its first token).

    A row from the zero state: its first token's time-mix output is GroupNorm((r·k) v) per head,
    whose sign turns where r·k is near 0, so that token's fp16 activations can move the whole row's
    logits (up to 3e-2 on the random 1.5B model; tools/fp16_rounding.py). Its first token takes the
    gemv step (fp32 activations), then the rest of the row the large path, in one call (one graph).
    No groups where no row is new, or where the call takes the gemv path (fp32) anyway."""
    new = [i for i, f in enumerate(fresh) if f]
    if not new or call_shape(len(lengths), sum(lengths))[1] <= EXACT_PREFILL:
        return [], list(range(len(lengths)))
    groups = [new[at:at + AUTO_PATH_MAX] for at in range(0, len(new), AUTO_PATH_MAX)]
    return groups, [i for i, n in enumerate(lengths) if not fresh[i] or n > 1]


def shape_key(lengths: Sequence[int], fresh: Sequence[bool]) -> tuple:
    """What a prefill call's graph (and its kernels' variants) follow: its steps' buckets and
    whether they want logits, the buckets of the call after them."""
    groups, rest = plan(lengths, fresh)
    steps = tuple((row_bucket(len(g)), any(lengths[i] == 1 for i in g)) for g in groups)
    went_on = [lengths[i] - (1 if groups and fresh[i] else 0) for i in rest]
    return steps, call_shape(len(went_on), sum(went_on)) if went_on else None


def buckets(max_rows: int) -> list[int]:
    """The decode graphs' batch sizes: powers of 2 up to the first that holds max_rows."""
    return [1 << i for i in range(row_bucket(max_rows).bit_length())]


def warm_up_calls(max_slots: int, vocab: int) -> list[list[tuple[list[int], bool]]]:
    """Prefill calls that between them launch every kernel variant prefill can: per call, its
    rows as (tokens, new prompt), one call a shape (shape_key: none is seen twice, so none is
    captured). Kernels specialise on what follows from a call's buckets: how many new rows its
    first-token step takes (1 to AUTO_PATH_MAX) and whether it wants their logits, how many rows
    the last layer's tail has (the gemv products up to AUTO_PATH_MAX, cuBLAS beyond), the tokens
    of the gemv path (1 to EXACT_PREFILL) and of the large path (the LayerNorm's program a token
    or run of tokens, the LoRAs' batching), a row or more (the pass's block of values)."""
    def row(n: int, fresh: bool = False) -> tuple[list[int], bool]:
        return [t % vocab for t in range(1, n + 1)], fresh

    big = EXACT_PREFILL + 2  # a row that alone takes the large path
    groups = min(max_slots - 1, AUTO_PATH_MAX)  # (one slot left for a row going on beside them)
    calls = [[row(n)] for n in range(1, EXACT_PREFILL + 1)]  # the gemv path, one row
    calls += [[row(1)] * r for r in range(2, min(max_slots, EXACT_PREFILL) + 1)]  # the gemv path, r rows
    # the large path's lengths, new and going on (64, and 65 new: one row that fills its buckets)
    for n in (big, 40, 64, 65, 100, 300, 600, 1100, 1600, 2100, 4100):
        calls += [[row(n)], [row(n, True)]]
    for g in range(1, groups + 1):  # first-token steps of g new rows, without and with their logits
        calls.append([row(big // g + 2, True)] * g)
        calls.append([row(1, True)] + [row(2, True)] * (g - 1) + [row(big)])
    for m in range(3, max_slots + 1):  # tails of up to max_slots rows (2 entries a row)
        calls.append([row(big)] + [row(1)] * (m - 1))
    seen, unique = set(), []
    for rows in calls:
        key = shape_key([len(tokens) for tokens, _ in rows], [fresh for _, fresh in rows])
        if key not in seen:
            seen.add(key)
            unique.append(rows)
    return unique
