"""The numba CPU kernels for bf16 models (`trt_engines.cpu_kernels`): accuracy against a float64 reference, batch
invariance by construction (property tests), and bad input. The engine-level tests of the same kernels are in
`test_engine.py` (bf16 logits equal plain decoding's on every branch of a tree)."""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trt_engines.cpu_kernels import (_ROWS_PER_TASK, VECTOR_FLOATS, Bf16Linear, TreeAttentionLayout, bf16_bits,
                                     huge_page_array, tree_attention, tree_attention_bits)

HYP = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
REPO = Path(__file__).resolve().parents[1]


class _Run:
    """A script run in a fresh Python process, started now and read later: its output goes to a log file."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-c", script, *args], env=env, cwd=REPO, stdout=out,
                                            stderr=subprocess.STDOUT)

    def output(self, timeout: float = 900) -> str:
        """Its output, once it has exited 0 (else the test fails with the tail of its log)."""
        code = self.process.wait(timeout)
        text = self.log.read_text()
        assert code == 0, text[-3000:]
        return text


def _digest(log: str) -> str:
    """The digest `_DECODE_BITS` printed (its log also holds whatever the process wrote to stderr)."""
    lines = [line for line in log.splitlines() if line.startswith('{"digest"')]
    assert len(lines) == 1, log[-3000:]
    return json.loads(lines[0])["digest"]


@pytest.fixture(scope="module")
def kernel_runs(tmp_path_factory):
    """This module's two runs in fresh processes, both started when the module's first test starts. Each compiles
    every kernel it uses afresh (the engine's alone compile for ~46 s in a fresh process, `compile_time.md`, on
    one core: numba compiles single-threaded), so they run beside this process's own tests, which compile theirs,
    rather than one after another (`make test`'s budget). A run of a single test of this module starts them too,
    and stops them when the module ends."""
    folder = tmp_path_factory.mktemp("kernel_runs")
    # other width: the vector-width test's other half; the override turns numba's on-disk cache off there
    other_width = {**os.environ, "RETROSPEC_CPU_VECTOR_FLOATS": "16" if VECTOR_FLOATS == 8 else "8"}
    # an empty cache of its own: the cache test's first run compiles into it, its second loads from it
    cache_env = {k: v for k, v in os.environ.items() if k != "RETROSPEC_CPU_VECTOR_FLOATS"}
    cache_env["NUMBA_CACHE_DIR"] = str(folder / "numba_cache")
    runs = {
        "other_width": _Run(_OUTPUTS_AT_A_WIDTH, [str(folder / "other.npz")], other_width, folder / "other.log"),
        "compiling": _Run(_DECODE_BITS, [], cache_env, folder / "compiling.log"),
    }
    yield {"folder": folder, "cache_env": cache_env, **runs}
    for run in runs.values():  # a test that failed early leaves nothing running
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


pytestmark = pytest.mark.usefixtures("kernel_runs")


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).bfloat16()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return 2.0 ** (exponent - 7)


@pytest.mark.parametrize("out_features, rows", [(960, 1), (576, 2), (500, 9), (963, 7), (64, 70), (5, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_the_bf16_rounding_of_the_fp32_product(out_features, rows, with_bias):
    # Rows beyond one kernel call (64), row counts that leave a partial group of six (1, 2 or 3 rows may take several
    # tiles per pass: `_tiles_per_pass`), output sizes that are not a multiple of the 16-feature tiles (padded)
    rng = np.random.default_rng(out_features + rows)
    weight, x = _bf16(rng, out_features, 576), _bf16(rng, rows, 576)
    bias = _bf16(rng, out_features) if with_bias else None
    got = Bf16Linear(weight, bias)(x)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T  # sum of |products|: what fp32 accumulation errs against
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # fp32 accumulation, then one rounding to bf16: one bf16 step from the exact value, plus fp32's summation error
    tolerance = _bf16_ulp(exact.float()).double() + 1e-5 * magnitude
    assert ((got.double() - exact).abs() <= tolerance).all()


@HYP
@given(rows=st.integers(1, 80), position=st.integers(0, 79), seed=st.integers(0, 2**16))
def test_linear_rows_do_not_depend_on_the_batch(rows, position, seed):
    rng = np.random.default_rng(seed)
    linear = Bf16Linear(_bf16(rng, 520, 200))  # 33 tiles: runs of several per task, and a run of one
    row = _bf16(rng, 1, 200)
    alone = linear(row)
    batch = _bf16(rng, rows, 200)
    at = position % rows
    batch[at] = row[0]
    # compared before the final rounding to bf16, which would hide most last-bit differences
    assert torch.equal(linear(batch, fp32_out=True)[at], linear(row, fp32_out=True)[0])
    assert torch.equal(linear(batch)[at], alone[0])


def test_linear_does_not_depend_on_the_thread_count():
    # The weight tiles are split into runs per thread (`_TASKS_PER_THREAD`): how many threads share the work changes
    # neither the order of any output's multiply-adds nor a bit of the output.
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a CPU with two cores")
    rng = np.random.default_rng(7)
    linear, x = Bf16Linear(_bf16(rng, 964, 576)), _bf16(rng, 9, 576)
    outputs = []
    for n in (1, 2):
        with _numba_threads(n):
            outputs.append(linear(x, fp32_out=True))
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])


def test_huge_page_arrays_are_zeroed_writable_and_aligned_to_their_pages():
    import mmap

    big = huge_page_array((3 << 18, 8), np.uint32)  # 24 MB: twelve huge pages
    assert big.shape == (3 << 18, 8) and big.dtype == np.uint32 and big.flags.c_contiguous and big.flags.writeable
    assert not big.any()
    big[-1, -1] = 7  # the last element lies inside the mapping
    assert big.sum() == 7
    if hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS"):
        assert big.ctypes.data % (2 << 20) == 0
    small = huge_page_array((5, 3), np.float32)  # under one huge page: ordinary memory
    assert small.shape == (5, 3) and not small.any()
    # a weight packed into such memory gives the same outputs as the product it stands for (the tests above)
    rng = np.random.default_rng(3)
    weight, x = _bf16(rng, 2048, 576), _bf16(rng, 3, 576)
    linear = Bf16Linear(weight)
    assert linear.packed.ctypes.data % (2 << 20) == 0 or not hasattr(mmap, "MADV_HUGEPAGE")
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert (linear(x).float() - expected.float()).abs().max() <= expected.float().abs().max() * 2 ** -7


@contextlib.contextmanager
def _numba_threads(n: int):
    """numba's parallel kernels run on `n` threads (at most the pool's) inside the block, as many as before after."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _tree_mask(parents: list[int]) -> np.ndarray:
    """[n + 1, n + 1] visibility among root + nodes (node i is row i + 1): itself and its ancestors."""
    n = len(parents)
    mask = np.eye(n + 1, dtype=bool)
    mask[:, 0] = True
    for i in range(n):
        p = parents[i]
        while p >= 0:
            mask[i + 1, p + 1] = True
            p = parents[p]
    return mask


trees = st.integers(0, 20).flatmap(
    lambda n: st.tuples(*[st.integers(-1, i - 1) for i in range(n)]).map(list))


def _paged(rng, kv_heads: int, slots: int, dim: int):
    k, v = _bf16(rng, kv_heads, slots, dim), _bf16(rng, kv_heads, slots, dim)
    return k, v, bf16_bits(k), bf16_bits(v)


@HYP
@given(parents=trees, context=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_tree_attention_matches_a_float64_reference(parents, context, seed):
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = 6, 2, 64  # SmolLM2's head_dim: the kernel the engine compiles (one per head_dim)
    k, v, k_bits, v_bits = _paged(rng, kv_heads, 128, dim)
    n = len(parents) + 1
    slots = rng.permutation(128)[: context + n]  # paged: a request's keys anywhere in the pool
    mask = _tree_mask(parents)
    q = _bf16(rng, n, heads, dim)
    got = tree_attention(q, k_bits, v_bits, TreeAttentionLayout([(0, context, slots, mask)]))
    keys, values = k[:, slots].double(), v[:, slots].double()
    for i in range(n):
        visible = np.concatenate([np.ones(context, bool), mask[i]])
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = q[i, h].double() @ keys[g, visible].T * dim ** -0.5
            want = torch.softmax(scores, -1) @ values[g, visible]
            assert torch.allclose(got[i, h * dim:(h + 1) * dim].double(), want, atol=0.02, rtol=0.02)


@HYP
@given(parents=trees, context=st.integers(1, 40), others=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_tree_attention_row_equals_plain_decoding_of_its_path(parents, context, others, seed):
    # Every tree row, on any branch and next to other requests, gets bitwise what plain decoding of its own path
    # gets: attention over the context and its ancestors laid out contiguously, alone in the batch. Long trees
    # split into several kernel tasks. The kernel is compiled per head_dim and output dtype: these tests use
    # SmolLM2's 64, and the vector-width test that and a head_dim of 40, whose last value tile is part padding.
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = 6, 2, 64
    _, _, k_bits, v_bits = _paged(rng, kv_heads, 512, dim)
    n = len(parents) + 1
    pool = rng.permutation(512)
    slots = pool[: context + n]
    mask = _tree_mask(parents)
    q = _bf16(rng, n, heads, dim)
    # other requests before it in the packed batch, with trees and contexts of their own
    segments, offset, used, queries = [], 0, context + n, []
    for _ in range(others):
        m, c = int(rng.integers(1, 6)), int(rng.integers(1, 30))
        segments.append((offset, c, pool[used:used + c + m], np.tril(np.ones((m, m), bool))))
        queries.append(_bf16(rng, m, heads, dim))
        offset, used = offset + m, used + c + m
    segments.append((offset, context, slots, mask))
    # compared before the final rounding to bf16, which would hide most last-bit differences
    batched = tree_attention(torch.cat(queries + [q]), k_bits, v_bits, TreeAttentionLayout(segments),
                             fp32_out=True)[offset:]
    for i in range(n):
        path = np.flatnonzero(mask[i])  # root, ancestors, itself: in slot order
        plain_slots = np.concatenate([slots[:context], slots[context + path]])
        alone = tree_attention(q[i:i + 1], k_bits, v_bits,
                               TreeAttentionLayout([(0, context + len(path) - 1, plain_slots, np.ones((1, 1), bool))]),
                               fp32_out=True)
        assert torch.equal(batched[i], alone[0]), f"row {i} (path {path.tolist()})"


@HYP
@given(rows=st.lists(st.integers(1, 40), min_size=1, max_size=8), kv_heads=st.sampled_from([1, 3]),
       group=st.sampled_from([1, 3]), workers=st.integers(1, 4))
def test_tree_attention_tasks_cover_every_row_once_in_equal_runs(rows, kv_heads, group, workers):
    # prange hands each thread an equal, contiguous share of the tasks: every share must hold one run of the
    # rows, and the runs must be as long as each other (within a row), whatever the segments' sizes
    first_rows = np.concatenate([[0], np.cumsum(rows)[:-1]])
    segments = [(int(r0), 5, np.arange(5 + n), np.tril(np.ones((n, n), bool))) for r0, n in zip(first_rows, rows)]
    segment, kv, first, count = TreeAttentionLayout(segments).tasks(kv_heads, group, workers)
    assert len(segment) % workers == 0 and count.max() <= _ROWS_PER_TASK and count.min() >= 0
    covered = {}
    for s, h, f, c in zip(segment, kv, first, count):
        assert 0 <= f and f + c <= rows[s] * group
        for row in range(f, f + c):
            covered[s, h, row] = covered.get((s, h, row), 0) + 1
    assert covered == {(s, h, r): 1 for s, n in enumerate(rows) for h in range(kv_heads) for r in range(n * group)}
    runs = count.reshape(workers, -1).sum(axis=1)
    assert runs.max() - runs.min() <= 1


def _packed_batch(rng, segments: list[tuple[int, np.ndarray]]):
    """q [T, 9, 64] bits, K/V pools (3 KV heads, 1024 slots, bits) and the layout of requests packed one after
    another: per request (context length, mask over its new tokens), its keys in random slots of the pool."""
    _, _, k_bits, v_bits = _paged(rng, 3, 1024, 64)
    pool = rng.permutation(1024)
    packed, offset, used = [], 0, 0
    for context, mask in segments:
        m = mask.shape[0]
        packed.append((offset, context, pool[used:used + context + m], mask))
        offset, used = offset + m, used + context + m
    return bf16_bits(_bf16(rng, offset, 9, 64)), k_bits, v_bits, TreeAttentionLayout(packed)


@HYP
@given(parents=trees, context=st.integers(0, 300), others=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_tree_attention_reading_the_pool_gives_the_bits_of_widened_copies(parents, context, others, seed):
    # The micro-kernels read keys and values straight from the paged pool (bf16, through the slots) and widen them
    # in registers; computing on fp32 copies of them (`widened_copy`, how every task ran before) must give the same
    # bits: the same values enter the same chains. Contexts reach past a few hundred keys, so the pool's blocks
    # scatter and a task's keys outnumber the score loop's tile several times over.
    rng = np.random.default_rng(seed)
    chains = [(int(rng.integers(0, 60)), np.tril(np.ones((int(rng.integers(1, 6)),) * 2, bool))) for _ in range(others)]
    q, k_bits, v_bits, layout = _packed_batch(rng, chains + [(context, _tree_mask(parents))])
    from_pool = tree_attention_bits(q, k_bits, v_bits, layout, fp32_out=True)
    from_copies = tree_attention_bits(q, k_bits, v_bits, layout, fp32_out=True, widened_copy=True)
    assert np.array_equal(from_pool.view(np.uint32), from_copies.view(np.uint32))


@HYP
@given(parents=trees, context=st.integers(0, 300), prefill=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rows_that_see_one_run_of_keys_skip_the_mask_with_the_same_bits(parents, context, prefill, seed):
    # A row that sees every new token of its segment up to the last one it sees (a causal prefill's rows, a
    # chain's) reads its keys as one run instead of through the mask (`TreeAttentionLayout.one_run`): the same
    # keys in the same order, so the same bits as the masked path, which every row takes with `mask_every_row`.
    rng = np.random.default_rng(seed)
    masks = [np.tril(np.ones((prefill, prefill), bool)), _tree_mask(parents)]
    q, k_bits, v_bits, layout = _packed_batch(rng, [(0, masks[0]), (context, masks[1])])
    want = [all(row[:np.flatnonzero(row).max() + 1]) for mask in masks for row in mask]
    assert layout.one_run.tolist() == [int(w) for w in want]
    one_run = tree_attention_bits(q, k_bits, v_bits, layout, fp32_out=True)
    masked = tree_attention_bits(q, k_bits, v_bits, layout, fp32_out=True, mask_every_row=True)
    assert np.array_equal(one_run.view(np.uint32), masked.view(np.uint32))


def test_tree_attention_does_not_depend_on_the_thread_count():
    # A request's three KV heads' rows are shared out in equal runs per thread (`TreeAttentionLayout.tasks`), so
    # the thread count decides which task computes a row, and must change none of its bits. One thread runs
    # alone; more runs than threads leave a thread several.
    rng = np.random.default_rng(5)
    _, _, k_bits, v_bits = _paged(rng, 3, 256, 64)
    segments = [(0, 40, rng.permutation(256)[:45], np.tril(np.ones((5, 5), bool))),
                (5, 90, rng.permutation(256)[:91], np.ones((1, 1), bool))]
    q = bf16_bits(_bf16(rng, 6, 9, 64))
    outputs = []
    for runs in (1, 2, 3, 4):
        with _numba_threads(runs):
            outputs.append(tree_attention_bits(q, k_bits, v_bits, TreeAttentionLayout(segments), fp32_out=True,
                                               threads=runs))
    assert all(np.array_equal(outputs[0].view(np.uint32), o.view(np.uint32)) for o in outputs[1:])


_OUTPUTS_AT_A_WIDTH = textwrap.dedent("""
    import sys
    import numpy as np, torch
    from trt_engines.cpu_kernels import VECTOR_FLOATS, Bf16Linear, TreeAttentionLayout, bf16_bits, tree_attention
    rng = np.random.default_rng(11)
    bf16 = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16()
    linear = Bf16Linear(bf16(100, 576), bf16(100))  # 100 features: a padded tile at either width
    outs = [linear(bf16(rows, 576), fp32_out=True) for rows in (1, 2, 7, 70)]
    odd = Bf16Linear(bf16(40, 33))  # an odd number of input features: the last bf16 pair is half padding
    outs += [odd(bf16(rows, 33), fp32_out=True) for rows in (1, 13)]
    mask = np.tril(np.ones((5, 5), bool))
    # head_dim 40: the values' last tile is part padding (widened copies); 64: the pool read in place
    for dim in (40, 64):
        k, v = bf16(2, 64, dim), bf16(2, 64, dim)
        outs.append(tree_attention(bf16(5, 6, dim), bf16_bits(k), bf16_bits(v),
                                   TreeAttentionLayout([(0, 20, rng.permutation(64)[:25], mask)]), fp32_out=True))
    # several requests' trees at once: tasks of many row counts for the score loop's blocks (`_scores`: six, four,
    # three, two rows; keys in pairs at 16 floats), and key counts that leave partial blocks of keys
    k, v = bf16(3, 512, 64), bf16(3, 512, 64)
    segments, first = [], 0
    for n, ctx in ((1, 7), (3, 40), (4, 0), (7, 101), (17, 230)):
        tree = np.tril(rng.random((n, n)) < 0.7) | np.eye(n, dtype=bool)
        segments.append((first, ctx, rng.permutation(512)[:ctx + n], tree))
        first += n
    outs.append(tree_attention(bf16(first, 9, 64), bf16_bits(k), bf16_bits(v), TreeAttentionLayout(segments),
                               fp32_out=True))
    np.savez(sys.argv[1], width=VECTOR_FLOATS, *[o.numpy() for o in outs])
""")


def test_outputs_do_not_depend_on_the_vector_width(tmp_path, monkeypatch, kernel_runs):
    # The micro-kernel works in 8- or 16-float vectors (AVX2 / AVX-512, `VECTOR_FLOATS`); every output is the same
    # chain of fused multiply-adds either way, and every attention score the same 8 partial sums added in the same
    # tree (one key a vector at 8 floats, two at 16), so the bits are the same (LLVM splits 16-float vectors into two on
    # AVX2, so both widths run on any x86 CPU). The width is fixed at import: this process computes at its own,
    # a subprocess (`kernel_runs`) at the other, which compiles every kernel afresh (the on-disk cache is off there).
    # On a CPU with AVX512-BF16 the 16-float side's linear layers multiply bf16 pairs with VDPBF16PS
    # (`BF16_DOT_PRODUCTS`) and the 8-float side's widen them for FMAs: the same chains, so this compares those too.
    script = tmp_path / "outputs.py"
    script.write_text(_OUTPUTS_AT_A_WIDTH)
    here = tmp_path / "here.npz"
    monkeypatch.setattr(sys, "argv", [str(script), str(here)])
    runpy.run_path(str(script), run_name="__main__")
    kernel_runs["other_width"].output()
    results = [np.load(here), np.load(kernel_runs["folder"] / "other.npz")]
    assert sorted(int(r["width"]) for r in results) == [8, 16]
    names = [n for n in results[0].files if n != "width"]
    assert len(names) == 9
    for name in names:
        assert np.array_equal(results[0][name], results[1][name]), name


def test_bad_bf16_dot_product_overrides_are_refused():
    for value, message in (("2", "RETROSPEC_CPU_BF16_DOT must be 0 or 1; got '2'"),
                           ("1", "RETROSPEC_CPU_BF16_DOT=1 needs AVX512-BF16 and 16-float vectors")):
        env = {**os.environ, "RETROSPEC_CPU_BF16_DOT": value, "RETROSPEC_CPU_VECTOR_FLOATS": "8"}
        done = subprocess.run([sys.executable, "-c", "import trt_engines.cpu_kernels"], env=env, capture_output=True,
                              text=True, cwd=REPO, timeout=300)
        assert done.returncode != 0 and message in done.stderr


def test_a_bad_vector_width_override_is_refused():
    env = {**os.environ, "RETROSPEC_CPU_VECTOR_FLOATS": "12"}
    done = subprocess.run([sys.executable, "-c", "import trt_engines.cpu_kernels"], env=env, capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode != 0 and "RETROSPEC_CPU_VECTOR_FLOATS must be 8 or 16; got '12'" in done.stderr


def test_bad_input_is_refused():
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 inputs"):
        Bf16Linear(weight)(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="contiguous bf16 CPU tensor"):
        Bf16Linear(weight.float())
    with pytest.raises(ValueError, match=r"expects x \[T, 4\]; got shape \(2, 5\)"):
        Bf16Linear(weight)(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in_features >= 1"):
        Bf16Linear(torch.zeros(8, 0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ctx \\+ rows keys"):
        TreeAttentionLayout([(0, 5, np.arange(4), np.ones((2, 2), bool))])
    bits = np.zeros((2, 4), np.uint16)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        Bf16Linear(weight).bits(bits, threads=0)
    layout = TreeAttentionLayout([(0, 3, np.arange(4), np.ones((1, 1), bool))])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        tree_attention_bits(np.zeros((1, 2, 16), np.uint16), np.zeros((1, 8, 16), np.uint16),
                            np.zeros((1, 8, 16), np.uint16), layout, threads=0)


def test_bad_kernel_choices_are_refused_before_loading_anything():
    from orchestrator.serving.stack import ServingConfig
    from trt_engines.torch_engine import TorchEngine

    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, numba, attention, torch; got 'fast'"):
        TorchEngine("default", cpu_kernels="fast")
    with pytest.raises(ValueError, match="runs bf16 models on the CPU"):
        TorchEngine("default", dtype=torch.float32, device="cpu", cpu_kernels="numba")
    with pytest.raises(ValueError, match="runs bf16 models on the CPU"):
        TorchEngine("default", dtype=torch.float32, device="cpu", cpu_kernels="attention")
    with pytest.raises(ValueError, match="batch-invariant by construction"):
        TorchEngine("default", device="cpu", cpu_kernels="numba", batch_invariant=False)
    with pytest.raises(ValueError, match="batch-invariant by construction"):
        TorchEngine("default", device="cpu", cpu_kernels="attention", batch_invariant=False)
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, numba, attention, torch; got 'fast'"):
        ServingConfig(cpu_kernels="fast")


_DECODE_BITS = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, torch
    from drafter.tree import DraftTree
    from trt_engines.base import VerifyItem
    from trt_engines.cpu_kernels import TreeAttentionLayout, bf16_bits, tree_attention
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    # SmolLM2's head shape: 9 heads of 64 over 3 KV heads
    config = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 512, "max_position_embeddings": 512}
    engine = TorchEngine(Transformer.random(config, dtype=torch.bfloat16, seed=3), dtype=torch.bfloat16,
                         device="cpu", cpu_kernels="numba", num_blocks=64)
    digest = hashlib.sha1()
    rng = np.random.default_rng(7)
    # the attention kernel alone, before the final rounding (which hides most last-bit differences): random
    # queries and keys of SmolLM2's size, contexts with every remainder of the kernels' 4- and 16-lanes
    bits = lambda shape: bf16_bits(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16())
    k_pool, v_pool = bits((3, 1024, 64)), bits((3, 1024, 64))
    for context, rows in ((100, 1), (437, 1), (50, 5), (0, 40), (213, 3)):
        layout = TreeAttentionLayout([(0, context, rng.permutation(1024)[:context + rows],
                                       np.tril(np.ones((rows, rows), bool)))])
        q = torch.from_numpy(rng.standard_normal((rows, 9, 64)).astype(np.float32) * 2).bfloat16()
        digest.update(tree_attention(q, k_pool, v_pool, layout, fp32_out=True).numpy().tobytes())
    # and a whole decode on two random layers: every numba kernel of the forward, in bf16
    for rid, length in enumerate((100, 37, 230)):
        root = engine.add_request(rid, rng.integers(0, 512, length).tolist())
        for _ in range(5):
            res = engine.verify([VerifyItem(rid, DraftTree.empty())], return_logits=True).results[0]
            digest.update(res.logits.float().numpy().tobytes())
            engine.commit(rid, [], next_root=int(res.target_tokens[0]))
        tree = DraftTree.from_arrays(tokens=[5, 9, 11, 7], parents=[-1, 0, 1, -1])  # a branch beside a chain of three
        res = engine.verify([VerifyItem(rid, tree)], return_logits=True).results[0]
        digest.update(res.logits.float().numpy().tobytes())
    print(json.dumps({"digest": digest.hexdigest()}))
""")


def test_a_process_that_compiles_the_kernels_and_one_that_loads_them_from_numbas_cache_agree(kernel_runs):
    # numba caches compiled kernels on disk. Under fast-math `reassoc` the attention kernel loaded from that cache
    # added its scores in another order than the copy its compiling process ran, so bf16 texts depended on whether
    # a process found the cache (the first run after an install decoded other texts than the next). The kernels now
    # spell out every order (`_dot_products`): the first subprocess (`kernel_runs`) compiles them into an empty
    # cache, the second loads them, and both must give bitwise the same logits.
    compiled = _digest(kernel_runs["compiling"].output())
    cache = kernel_runs["folder"] / "numba_cache"
    assert list(cache.rglob("*_tree_attention_kernel*.nbi")), "the first run cached no attention kernel"
    loading = _Run(_DECODE_BITS, [], kernel_runs["cache_env"], kernel_runs["folder"] / "loading.log")
    assert _digest(loading.output()) == compiled


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_layout_reach_and_runs_follow_their_definition(sizes, seed):
    # per packed row: `reach` is the last new token of its segment it sees, `one_run` whether it sees all of them
    # up to there (its keys then go as one run); masks of any shape, each row seeing itself
    rng = np.random.default_rng(seed)
    segments, first = [], 0
    for k in sizes:
        mask = rng.random((k, k)) < 0.5
        mask[np.arange(k), np.arange(k)] = True
        segments.append((first, 3, np.arange(3 + k, dtype=np.int32), mask))
        first += k
    layout = TreeAttentionLayout(segments)
    for first, _, _, mask in segments:
        for i, row in enumerate(mask):
            last = int(np.flatnonzero(row).max())
            assert layout.reach[first + i] == last
            assert layout.one_run[first + i] == int(row[: last + 1].all())
    assert layout.key_slots.dtype == np.int64 and layout.mask.dtype == np.uint8
