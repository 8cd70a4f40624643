"""Checks of the Triton kernels (the indexer's, the norm, rope, router, SwiGLU and sparse MLA kernels) that run without a GPU (used by tests/kernels/test_triton_cpu.py, each in
its own process; also a tool: `python tests/kernels/triton_cpu_checks.py <check>`).

- `interpret-*`: the kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy on CPU tensors) against
  the references: the top-k kernel must return exactly kernels/topk_ref.py's positions on every path; the scores
  kernel must equal a float64 emulation of its documented rounding (per-head power-of-two scaling, q rounded to
  fp16 / fp16 hi + lo / e4m3) to fp32 accuracy, for each precision.
- `compile-*`: the kernels are compiled for sm_90 (Triton's own LLVM and ptxas, no GPU needed) with the argument
  specialization a launch gives them, and the compiled code must keep the properties the speed depends on:
  in the scores kernel, no synchronous global load in the main (dot) loop, key tiles multi-buffered, the scale
  loop pipelined; in the top-k kernel, the scan loops pipelined.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else ""
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if MODE.startswith("interpret"):
    from kernels import triton_interpret

    triton_interpret.enable()

import torch  # noqa: E402
import triton  # noqa: E402


def _fail(msg: str) -> None:
    print("FAILED:", msg)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------------- interpret


def interpret_kth_key() -> None:
    """The threshold search returns the sorted array's key for every rank of arrays with ties, ±0, ±inf and NaN
    (their order keys), partly masked: on every rank, so that a bit decided wrongly at any level shows."""
    import triton.language as tl

    from kernels import topk_triton

    # The kernel below looks its callees up in this module's globals (as Triton resolves names).
    globals().update(_kth_key=topk_triton._kth_key)

    @triton.jit
    def kth(keys_ptr, n, rank, out_ptr, SIZE: tl.constexpr):
        idx = tl.arange(0, SIZE)
        valid = idx < n
        keys = tl.load(keys_ptr + idx, mask=valid, other=-2147483648)
        tl.store(out_ptr, _kth_key(keys, valid, rank))  # noqa: F821 - put in globals above

    gen = torch.Generator().manual_seed(3)
    cases = {
        "distinct": torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int64).to(torch.int32),
        "few values": torch.randint(-3, 4, (64,), generator=gen, dtype=torch.int32) * 2**24,
        "shared high bytes": 0x3F800000 + torch.randint(0, 300, (64,), generator=gen, dtype=torch.int32),
        "extremes": torch.tensor([-2**31, 2**31 - 1, 0, -1, 1, 0x7F800000, -0x7F800001, 0x7FFFFFFF] * 8,
                                 dtype=torch.int32),
    }
    out = torch.empty(1, dtype=torch.int32)
    for name, keys in cases.items():
        for n in (64, 37):
            for rank in range(1, n + 1):
                kth[(1,)](keys, n, rank, out, SIZE=64)
                want = int(keys[:n].sort(descending=True).values[rank - 1])
                if int(out) != want:
                    _fail(f"k-th key, {name}, n {n}, rank {rank}: {int(out)}, want {want}")
        print(f"k-th key ({name}): the sorted key at every rank")


def interpret_topk() -> None:
    from kernels import topk_triton
    from kernels.topk_ref import topk_positions_ref
    from kernels.topk_triton import topk_positions_triton

    gen = torch.Generator().manual_seed(0)

    def check(name: str, scores: torch.Tensor, lens: torch.Tensor, k: int, paths_wanted: list[int] | None = None):
        want = topk_positions_ref(scores, lens, k)
        t0 = time.time()
        got, paths = topk_positions_triton(scores, lens, k, return_paths=True)
        if not torch.equal(got, want):
            row = int((got != want).any(1).nonzero()[0])
            _fail(f"{name}: row {row} differs: got {got[row, :12].tolist()} want {want[row, :12].tolist()}")
        if paths_wanted is not None and paths.tolist() != paths_wanted:
            _fail(f"{name}: paths {paths.tolist()} != {paths_wanted}")
        print(f"{name}: ok, paths {paths.tolist()} ({time.time() - t0:.1f} s)")

    k = 64
    small = torch.randn(8, 700, generator=gen)
    small[1] = torch.randint(0, 6, (700,), generator=gen).float()  # many ties
    small[2, ::3] = float("-inf")
    small[3] = 2.5  # all equal
    small[4, 5:300] = -0.0
    small[4, 300:600] = 0.0
    small[4, [7, 99, 650]] = float("nan")
    small[5] = float("-inf")
    lens = torch.tensor([700, 650, 500, 400, 700, 300, k, k + 1])
    check("short rows, ties, -inf, nan, ±0", small, lens, k, [1, 1, 1, 1, 1, 1, 0, 1])

    # Rows above the candidate capacity (8192 for k 2048): sampled threshold; path 2 (threshold = estimate) on
    # an all-equal row; path 3 when the sample lies (only the sampled positions high: too few candidates; only
    # they low: too many).
    k, n = 2048, 12000
    long = torch.randn(5, n, generator=gen)
    long[1] = torch.randint(0, 40, (n,), generator=gen).float()
    long[2] = -1.0
    sampled = torch.tensor(topk_triton.sample_positions(n))
    long[3] = torch.rand(n, generator=gen)
    long[3, sampled] += 10.0
    long[4] = torch.rand(n, generator=gen) + 10.0
    long[4, sampled] -= 10.0
    check("long rows, every path", long, torch.full((5,), n), k, [1, 1, 2, 3, 3])
    check("long rows, shorter lengths", long, torch.tensor([n - 1, 9000, 8193, 8192, 2049]), k)

    real = torch.randn(1, 32768, generator=gen)
    check("k 2048 of 32768", real, torch.tensor([32768]), k, [1])


def _emulated_scores(q, w, keys, scales, rows, n, precision):
    """float64 emulation of kernels/indexer_fast.py's documented rounding of q (the keys are exact)."""
    q, w = q.double(), w.double()
    e = torch.floor(torch.log2(q.abs().amax(1)))
    shift = (7 - e) if precision == "fp8" else (8 - e)
    qs = (q * (2.0**shift)[:, None]).float()
    if precision == "fp8":
        qq = torch.where(qs.abs() < 2**-6, torch.zeros_like(qs), qs.to(torch.float8_e4m3fn).float()).double()
    elif precision == "fp16":
        qq = qs.half().double()
    else:
        hi = qs.half()
        qq = hi.double() + (qs - hi.float()).half().double()
    k = keys[rows[:n].long()].double()
    return ((qq @ k.T).relu() * (w * 2.0 ** (-shift))[:, None]).sum(0) * scales[rows[:n].long()].double()


def interpret_scores() -> None:
    from kernels.indexer_fast import PRECISIONS, FastScoresConfig, indexer_scores_fast, indexer_topk_fast
    from kernels.indexer_ref import quantize_index_keys
    from kernels.topk_ref import topk_positions_ref

    gen = torch.Generator().manual_seed(1)
    keys, scales = quantize_index_keys(torch.randn(3000, 128, generator=gen))
    table = torch.stack([torch.randperm(3000, generator=gen)[:1100] for _ in range(3)]).to(torch.int32)
    table[1, 600:] = -1  # beyond that request's length
    token_rows = table[:, :1000]  # a slice, like the engine's
    token_req = torch.tensor([0, 1, 2, 0, 2])
    seq_lens = torch.tensor([1000, 517, 999, 1, 64])
    for heads in (8, 64):
        q = torch.randn(5, heads, 128, generator=gen) * 3
        w = torch.randn(5, heads, generator=gen)
        for precision in PRECISIONS:
            cfg = FastScoresConfig(precision=precision)
            scores = indexer_scores_fast(q, w, keys, scales, token_rows, token_req, seq_lens, cfg)
            worst = 0.0
            for t in range(5):
                n = int(seq_lens[t])
                exact = _emulated_scores(q[t], w[t], keys, scales, token_rows[int(token_req[t])], n, precision)
                worst = max(worst, float((scores[t, :n].double() - exact).abs().max() / exact.abs().max()))
            if worst > 1e-6:
                _fail(f"scores {precision} H {heads}: {worst:.2e} from the emulation")
            picked = indexer_topk_fast(q, w, keys, scales, token_rows, token_req, seq_lens, 200, cfg)
            want = topk_positions_ref(scores, seq_lens, 200)
            if not torch.equal(picked, want):
                _fail(f"indexer_topk_fast {precision} H {heads}: not the rule applied to its own scores")
            print(f"scores {precision} H {heads}: {worst:.1e} from the emulation; top-k = rule(scores)")
        _check_e4m3_query(q, w, keys, scales, token_rows, token_req, seq_lens)
    _check_write_index_rows(gen)
    _check_balanced_split(gen)


def _check_balanced_split(gen: torch.Generator) -> None:
    """The balanced kernel (decode batches, e4m3 q: the batch's blocks split evenly over the grid, a program's
    share running across queries) gives the per-query kernel's bits at every visible position, whatever the
    grid: zero and one-block lengths, lengths past the table's width, unfilled row ids, a share spanning several
    queries and programs left without work."""
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, quantize_query
    from kernels.indexer_ref import quantize_index_keys

    keys, scales = quantize_index_keys(torch.randn(4096, 128, generator=gen))
    max_len = 640
    for lens in ([640, 0, 37, 640, 129], [1, 1, 700], [0, 0, 5], [640], [64] * 9):
        batch = len(lens)
        token_rows = torch.randint(0, 4096, (batch, max_len), generator=gen, dtype=torch.int32)
        token_rows[0, 3] = -1
        seq_lens = torch.tensor(lens)
        token_req = torch.arange(batch)
        q8, w8 = quantize_query(torch.randn(batch, 16, 128, generator=gen), torch.randn(batch, 16, generator=gen))
        want = indexer_scores_fast(q8, w8, keys, scales, token_rows, token_req, seq_lens,
                                   FastScoresConfig(balanced=False))
        for programs in (1, 3, 7, 40):
            got = indexer_scores_fast(q8, w8, keys, scales, token_rows, token_req, seq_lens,
                                      FastScoresConfig(balanced=True, programs_per_sm=programs))
            for t, n in enumerate(min(n, max_len) for n in lens):
                if not torch.equal(got[t, :n], want[t, :n]):
                    _fail(f"balanced scores, lengths {lens}, {programs} programs: query {t} differs")
    print("balanced split: the per-query kernel's bits (5 batches x 4 grids)")


def _check_write_index_rows(gen: torch.Generator) -> None:
    """`write_index_rows` (the Triton kernel, interpreted) writes what indexed assignment writes; rows < 0 are
    skipped, every other row of the destination is left as it was."""
    from kernels.indexer_fast import write_index_rows
    from kernels.indexer_ref import quantize_index_keys

    dst_keys, dst_scales = quantize_index_keys(torch.randn(100, 128, generator=gen))
    keys, scales = quantize_index_keys(torch.randn(37, 128, generator=gen))
    rows = torch.randperm(100, generator=gen)[:37]
    rows[5] = -1
    want_keys, want_scales = dst_keys.clone(), dst_scales.clone()
    kept = rows >= 0
    want_keys[rows[kept]] = keys[kept]
    want_scales[rows[kept]] = scales[kept]
    write_index_rows(dst_keys, dst_scales, rows, keys, scales)
    if not (torch.equal(dst_keys.view(torch.uint8), want_keys.view(torch.uint8))
            and torch.equal(dst_scales, want_scales)):
        _fail("write_index_rows: not the indexed assignment's bytes")
    print("index-key write: the indexed assignment's bytes, rows < 0 skipped")


def _check_e4m3_query(q, w, keys, scales, token_rows, token_req, seq_lens) -> None:
    """`quantize_query` gives the operand and weights the fp8 scores kernel computes itself: its q equals a
    float64 emulation of the per-head scaling and e4m3 rounding, its weights (w · 0.3) · 2^-shift exactly, and the
    scores kernel on them equals the kernel on the float query bit for bit."""
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, quantize_query

    weight_scale = 0.3  # not a power of two: the product's rounding must be torch's
    q8, w8 = quantize_query(q, w, weight_scale)
    shift = 7 - torch.floor(torch.log2(q.double().abs().amax(2)))  # [T, H]
    qs = (q.double() * (2.0**shift)[..., None]).float()
    want_q = torch.where(qs.abs() < 2**-6, torch.zeros_like(qs), qs.to(torch.float8_e4m3fn).float())
    if q8.dtype != torch.float8_e4m3fn or not torch.equal(q8.float(), want_q):
        _fail("quantize_query: q differs from the emulated per-head e4m3 rounding")
    if not torch.equal(w8, (w * weight_scale) * (2.0 ** -shift).float()):
        _fail("quantize_query: weights differ from (w · weight_scale) · 2^-shift")
    fp8 = FastScoresConfig(precision="fp8")
    want = indexer_scores_fast(q, w * weight_scale, keys, scales, token_rows, token_req, seq_lens, fp8)
    for cfg in (fp8, FastScoresConfig(precision="fp16")):  # e4m3 q runs the FP8 dot whatever the precision
        got = indexer_scores_fast(q8, w8, keys, scales, token_rows, token_req, seq_lens, cfg)
        for t in range(q.shape[0]):
            n = int(seq_lens[t])
            if not torch.equal(got[t, :n], want[t, :n]):
                _fail(f"scores of the e4m3 query ({cfg.precision} config) differ from the float query's, query {t}")
    print(f"e4m3 query H {q.shape[1]}: emulated bits; scores equal to the float query's in fp8")


# ------------------------------------------------------------------------------------------------------ compile


def _compile_sm90(fn, types: dict[str, str], constexprs: dict, aligned: list[str], num_warps: int, num_stages: int,
                  maxnreg: int | None = None):
    """Compile as a launch would specialize it: pointers and the listed ints divisible by 16, ints equal to 1
    constant; `maxnreg`: the launch's register cap, if any."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def _resources(kernel) -> str:
    """Registers, spills and shared memory of a compiled kernel, read from its cubin by the cuobjdump that
    ships with Triton."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    if not found:
        return f"{kernel.metadata.shared} B shared"
    return (f"{found.group(1)} registers, {found.group(3)} B spilled, stack {found.group(2)} B, "
            f"{kernel.metadata.shared} B shared")


def _main_loop_ops(kernel) -> collections.Counter[str]:
    """Opcode counts of a compiled kernel's longest SASS loop (its main loop), read with the nvdisasm that ships
    with Triton: what the benchmark folders' compile-time figures (instructions a tile, HGMMA, spills) count."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        lines = subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line.strip())}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and m.group(1) in labels and labels[m.group(1)] < i]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(m.group(2) for line in lines[start:end + 1]
                               if (m := re.match(r"^\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))


def _loops(ttgir: str) -> list[str]:
    """Bodies of the scf.for loops of a TTGIR module (outermost text up to the matching brace)."""
    bodies = []
    for match in re.finditer(r"scf\.for ", ttgir):
        depth, i = 0, ttgir.index("{\n", match.start())
        for j in range(i, len(ttgir)):
            depth += {"{": 1, "}": -1}.get(ttgir[j], 0)
            if depth == 0:
                bodies.append(ttgir[i:j])
                break
    return bodies


def _scores_signature(q_type: str, extra_ints: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Argument types of the scores kernels as the engine launches them (int64 request ids and lengths, int32 row
    ids), and the arguments a launch sees divisible by 16; `extra_ints`: the kernel's own int arguments."""
    types = {"q_ptr": q_type, "w_ptr": "*fp32", "keys_ptr": "*u8", "scales_ptr": "*fp32", "rows_ptr": "*i32",
             "req_ptr": "*i64", "lens_ptr": "*i64", "out_ptr": "*fp32"}
    types |= {name: "i32" for name in ("stride_qt", "stride_qh", "stride_wt", "stride_keys", "stride_rows_b",
                                       "stride_out", "num_heads", "max_len", *extra_ints)}
    aligned = [n for n in types if n.endswith("_ptr")] + ["stride_qt", "stride_qh", "stride_wt", "stride_keys",
                                                          "stride_out", "num_heads"]
    return types, aligned


def compile_scores(precision: str, q_e4m3: bool = False, early: bool = False) -> None:
    """precision "fp8" with q_e4m3: the variant that reads a query `quantize_query` made (the engine's on CUDA);
    early: that variant launched as a programmatic dependent (the engine's, after the index-key write)."""
    from kernels.indexer_fast import _PRECISION_CODE, DEFAULT_CONFIG, _scores_kernel

    cfg = DEFAULT_CONFIG
    types, aligned = _scores_signature("*u8" if q_e4m3 else "*fp32", ("blocks_per_prog",))
    constexprs = {"stride_rows_l": 1, "HEADS_P": 64, "BLOCK_N": cfg.block_n, "PRECISION": _PRECISION_CODE[precision],
                  "Q_E4M3": q_e4m3, "EARLY": early}
    t0 = time.time()
    kernel = _compile_sm90(_scores_kernel, types, constexprs, aligned, cfg.num_warps, cfg.num_stages)
    if early:
        _check_early_start(kernel.asm["ptx"])
    ttgir = kernel.asm["ttgir"]
    loops = _loops(ttgir)
    main = [body for body in loops if "warp_group_dot" in body]
    if len(main) != 1:
        _fail(f"expected one loop with a dot, found {len(main)}")
    # The key rows and their row ids come through async copies; the only synchronous loads are the next block's
    # row ids and scales, loaded one iteration before their use (kernels/indexer_fast.py).
    sync_loads = main[0].count("tt.load")
    async_copies = main[0].count("async_copy_global_to_local")
    if sync_loads != 2 or async_copies < 2:
        _fail(f"main loop: {sync_loads} synchronous loads (want the 2 look-ahead ones), {async_copies} async copies")
    buffers = re.findall(r"memdesc<(\d+)x" + str(cfg.block_n) + r"x128xi8", ttgir)
    if not buffers or max(int(b) for b in buffers) < 2:
        _fail(f"key tiles are not multi-buffered ({buffers})")
    if len(loops) != 1:
        _fail(f"expected the main loop only (the scales are applied in it), found {len(loops)} loops")
    print(f"scores {precision}{' (e4m3 q given)' if q_e4m3 else ''}: compiled for sm_90 in {time.time() - t0:.0f} s, {_resources(kernel)}; main loop "
          f"fully asynchronous, {max(int(b) for b in buffers)} key tiles buffered")


def compile_scores_balanced(early: bool) -> None:
    """The balanced scores kernel (the engine's on CUDA for decode batches) compiled for sm_90 at 64 heads and 256
    queries: no spills, the dot's loop fully asynchronous as in the per-query kernel; early: only the lengths, the
    first query's request, length and row ids are read before griddepcontrol.wait and the first keys are
    prefetched; q and the keys come after it."""
    from kernels.indexer_fast import DEFAULT_CONFIG, _scores_balanced_kernel

    cfg = DEFAULT_CONFIG
    types, aligned = _scores_signature("*u8", ("num_q",))
    constexprs = {"stride_rows_l": 1, "HEADS_P": 64, "BLOCK_N": cfg.block_n, "BLOCK_T": 256, "EARLY": early}
    t0 = time.time()
    kernel = _compile_sm90(_scores_balanced_kernel, types, constexprs, aligned, cfg.num_warps, cfg.num_stages,
                           cfg.max_registers)
    ttgir = kernel.asm["ttgir"]
    # The segments' loop holds the blocks' loop: the innermost loop with the dot is the main loop.
    main = [body for body in _loops(ttgir) if "warp_group_dot" in body and "scf.for" not in body]
    if len(main) != 1:
        _fail(f"balanced scores: expected one innermost loop with a dot, found {len(main)}")
    sync_loads = main[0].count("tt.load")
    async_copies = main[0].count("async_copy_global_to_local")
    if sync_loads != 2 or async_copies < 2:
        _fail(f"balanced scores: main loop has {sync_loads} synchronous loads (want 2), {async_copies} async copies")
    if early:
        lines = kernel.asm["ptx"].splitlines()
        waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        if len(waits) != 1:
            _fail(f"balanced early scores: {len(waits)} griddepcontrol.wait (want one, reached by every program)")
        before, after = lines[: waits[0]], lines[waits[0]:]
        if any("cp.async" in line for line in before) or not any("cp.async" in line for line in after):
            _fail("balanced early scores: key copies before the wait")
        if not any("prefetch.global.L2" in line for line in before):
            _fail("balanced early scores: the first key rows are not prefetched before the wait")
        # q: 64 heads x 128 bytes, loaded as 4-byte-or-wider vectors by 128 threads; before the wait only the
        # lengths (256 x 8 bytes) and scalars.
        q_loads = [line for line in before if re.search(r"ld\.global(\.\w+)*\.(v4\.b32|v4\.u32)", line)]
        if q_loads:
            _fail(f"balanced early scores: {len(q_loads)} 16-byte loads (q) before the wait")
    resources = _resources(kernel)
    spilled = re.search(r"(\d+) B spilled", resources)
    if spilled and int(spilled.group(1)):
        _fail(f"balanced scores: {resources}")
    # The cap keeps 4 programs of 4 warps an SM (65536 registers / (4 x 128 threads) = 128 a thread).
    registers = re.search(r"(\d+) registers", resources)
    if cfg.max_registers and registers and int(registers.group(1)) > cfg.max_registers:
        _fail(f"balanced scores: {resources}, above the cap of {cfg.max_registers}")
    print(f"scores balanced{' early' if early else ''}: compiled for sm_90 in {time.time() - t0:.0f} s, "
          f"{resources}; main loop fully asynchronous")


def _check_early_start(ptx: str) -> None:
    """The early-start scores kernel's PTX: before its first griddepcontrol.wait only the request id, its length
    and the first block's row ids are loaded (what the engine wrote before the kernel launched just before) and
    the first key rows are prefetched into the L2; q, weights, scales and keys come after it; every program
    reaches a wait (the branch for spans beyond the length has its own)."""
    lines = ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    if len(waits) != 2:
        _fail(f"early scores: {len(waits)} griddepcontrol.wait (want one on each branch)")
    before, after = lines[: waits[0]], lines[waits[0]:]
    # The request id and length are 64-bit scalars, a block's row ids 32-bit ones; q and the weights are loaded
    # as vectors (v2 / v4), the keys by async copies.
    loads = [line for line in before if re.search(r"\bld\.global", line)]
    if (len(loads) > 6 or any(".v2." in line or ".v4." in line for line in loads)
            or any("cp.async" in line for line in before)):
        _fail(f"early scores: {len(loads)} loads / async copies before the wait (want the request, length and "
              "row-id loads only)")
    if not any(re.search(r"\bld\.global\.v[24]", line) for line in after):
        _fail("early scores: no vector load (q, weights) after the wait")
    if not any("prefetch.global.L2" in line for line in before):
        _fail("early scores: the first key rows are not prefetched before the wait")
    print(f"early scores: {len(loads)} loads and the first keys' L2 prefetch before griddepcontrol.wait")


def compile_write_index_rows() -> None:
    """The index-key write kernel compiled for sm_90 as the engine launches it: griddepcontrol.launch_dependents
    before any memory access (the scores kernel after it may start at once), no spills."""
    from kernels.indexer_fast import _write_index_rows_kernel

    types = {"keys_ptr": "*u8", "scales_ptr": "*fp32", "rows_ptr": "*i64", "dst_keys_ptr": "*u8",
             "dst_scales_ptr": "*fp32", "stride_src": "i32", "stride_dst": "i32", "num": "i32"}
    kernel = _compile_sm90(_write_index_rows_kernel, types, {"LET_NEXT_START": True, "BLOCK_T": 16},
                           ["keys_ptr", "dst_keys_ptr", "stride_src", "stride_dst"], 4, 1)
    lines = kernel.asm["ptx"].splitlines()
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    memory = [i for i, line in enumerate(lines) if re.search(r"\b(ld|st)\.global", line)]
    if len(trigger) != 1 or not memory or trigger[0] > memory[0]:
        _fail(f"index-key write: launch_dependents at {trigger}, first memory access at {memory[:1]}")
    usage = _resources(kernel)
    if " 0 B spilled" not in usage:
        _fail(f"index-key write spills: {usage}")
    print(f"index-key write: dependents released before its first access; {usage}")


def compile_topk() -> None:
    from kernels.topk_triton import (
        NUM_WARPS,
        SAMPLE_CHUNK,
        SAMPLE_CHUNKS,
        SCAN_BLOCK,
        SCAN_STAGES,
        _topk_kernel,
        candidate_capacity,
    )

    types = {"scores_ptr": "*fp32", "lens_ptr": "*i64", "out_ptr": "*i32", "cand_key_ptr": "*i32",
             "cand_pos_ptr": "*i32", "paths_ptr": "*i32", "stride_s": "i32", "stride_o": "i32", "stride_c": "i32",
             "width": "i32", "top_k": "i32"}
    aligned = [n for n in types if n.endswith("_ptr")] + ["stride_s", "stride_o", "stride_c", "top_k"]
    constexprs = {"CAPACITY": candidate_capacity(2048), "BLOCK": SCAN_BLOCK, "CHUNKS": SAMPLE_CHUNKS,
                  "CHUNK": SAMPLE_CHUNK, "STAGES": SCAN_STAGES}
    t0 = time.time()
    kernel = _compile_sm90(_topk_kernel, types, constexprs, aligned, NUM_WARPS, 3)
    scans = [body for body in _loops(kernel.asm["ttgir"]) if "tt.cumsum" in body or "tt.scan" in body]
    if not scans or any("tt.load" in body for body in scans):
        _fail("a scan loop of the top-k kernel is not pipelined")
    print(f"top-k: compiled for sm_90 in {time.time() - t0:.0f} s, {_resources(kernel)}; scan loops pipelined")


def compile_gemv() -> None:
    """The FP8 one-row kernels (kernels/fp8_gemm_triton.py) at every launch shape the tuner offers: no spills, and
    with `gemv_stages` > 1 the weight tiles of the loop are copied asynchronously into shared memory, stages − 1
    tiles ahead (the pipeliner took the loop; a plain loop has no asynchronous copy)."""
    from kernels.fp8_gemm import GEMV_CANDIDATES, GROUPED_GEMV_CANDIDATES, GROUPED_GEMV_ROW_CANDIDATES
    from kernels.fp8_gemm_triton import (
        _fp8_gemv_kernel,
        _fp8_grouped_gemv_kernel,
        _fp8_grouped_gemv_rows_kernel,
    )

    common = {"b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "n": "i32", "k": "i32", "stride_asg": "i32",
              "stride_bn": "i32", "stride_bsn": "i32", "stride_bsk": "i32", "ends_ptr": "*i32", "stride_am": "i32",
              "stride_be": "i32", "stride_bse": "i32", "stride_cm": "i32", "experts": "i32"}
    for kernel_fn, candidates in ((_fp8_gemv_kernel, GEMV_CANDIDATES),
                                  (_fp8_grouped_gemv_kernel, GROUPED_GEMV_CANDIDATES),
                                  (_fp8_grouped_gemv_rows_kernel, GROUPED_GEMV_ROW_CANDIDATES)):
        for block_n, groups, warps, fused, stages in candidates:
            types = {**common, "a_ptr": "*bf16" if fused else "*fp8e4nv", "as_ptr": "*bf16" if fused else "*fp32"}
            aligned = [n for n in kernel_fn.arg_names if n.endswith("_ptr")] + ["n", "k", "stride_bn", "stride_am",
                                                                               "stride_be"]
            constexprs = {"BLOCK_N": block_n, "GROUPS": groups, "SCALE_BN": 128, "FUSE_QUANT": fused,
                          "STAGES": stages}
            if "EXPERTS_P2" in kernel_fn.arg_names:
                constexprs["EXPERTS_P2"] = 256  # DeepSeek-V3.2's routed experts on one rank
            kernel = _compile_sm90(kernel_fn, {n: types[n] for n in kernel_fn.arg_names if n in types}, constexprs,
                                   [n for n in aligned if n in kernel_fn.arg_names], warps, 3)
            copies = sum(body.count("async_copy_global_to_local") for body in _loops(kernel.asm["ttgir"]))
            label = f"{kernel_fn.__name__} bn{block_n} g{groups} w{warps} ls{stages}{' fq' if fused else ''}"
            resources = _resources(kernel)
            if re.search(r", [1-9]\d* B spilled", resources):
                _fail(f"{label} spills: {resources}")
            tiles_ahead = (stages - 1) * block_n * groups * 128  # bytes of weight tiles the pipeline holds
            if (stages > 1) != (copies > 0) or kernel.metadata.shared < tiles_ahead:
                _fail(f"{label}: {copies} asynchronous copies in its loops, {kernel.metadata.shared} B of shared "
                      f"memory for {tiles_ahead} B of weight tiles ahead")
            print(f"{label}: {resources}; {copies} asynchronous copies in the loop")


def compile_bmm() -> None:
    """The batched FP8 kernels (kernels/fp8_bmm_triton.py: MLA's absorbed products) at every configuration the
    tuner offers for DeepSeek-V3.2's two products (W_UK: N 512, K 128; W_UV: N 128, K 512) and token counts 1–256:
    they compile for sm_90 without spills; the tensor-core form's tiles of 64 rows and more use wgmma."""
    import torch as _torch

    from kernels import fp8_gemm
    from kernels.fp8_bmm_triton import _fp8_bmm_gemv_kernel, _fp8_bmm_kernel

    fp8_gemm._sm_count = lambda index: 132  # no GPU here: the H100's SM count (candidates do not depend on it)
    types = {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "m": "i32", "n": "i32",
             "k": "i32", "k_tiles": "i32", **{name: "i32" for name in ("stride_ag", "stride_am", "stride_bg",
                                                                     "stride_bn", "stride_bsg", "stride_bsn",
                                                                     "stride_bsk", "stride_cg", "stride_cm")}}
    configs = {c.config for tokens in (1, 2, 16, 32, 64, 128, 256) for n, k in ((512, 128), (128, 512))
               for c in fp8_gemm.triton_candidates("batched", tokens, n, k, 128, _torch.device("cuda", 0))}
    for config in sorted(configs, key=lambda c: c.label()):
        if config.gemv_groups:
            fn, constexprs = _fp8_bmm_gemv_kernel, {"BLOCK_N": config.block_n, "GROUPS": config.gemv_groups,
                                                    "SCALE_BN": 128, "STAGES": config.gemv_stages}
        else:
            fn, constexprs = _fp8_bmm_kernel, {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": 128,
                                               "SCALE_BN": 128}
        aligned = [n for n in fn.arg_names if n.endswith("_ptr")] + ["n", "k", "stride_bn", "stride_am"]
        kernel = _compile_sm90(fn, {n: types[n] for n in fn.arg_names if n in types}, constexprs,
                               [n for n in aligned if n in fn.arg_names], config.num_warps, config.num_stages)
        resources = _resources(kernel)
        if re.search(r", [1-9]\d* B spilled", resources):
            _fail(f"batched {config.label()} spills: {resources}")
        wgmma = "warp_group_dot" in kernel.asm["ttgir"] or "wgmma" in kernel.asm["ptx"]
        if not config.gemv_groups and config.block_m >= 64 and not wgmma:
            _fail(f"batched {config.label()}: no wgmma")
        print(f"batched {config.label()}: {resources}{'; wgmma' if wgmma else ''}")


def interpret_norm_rope() -> None:
    """The one-kernel RMSNorm and rotary embedding (kernels/norm_rope_triton.py) in float32, where the
    interpreter's arithmetic is the GPU's (its bfloat16 casts are not: the GPU tests check bf16): rope equals the
    eager reference bit for bit (both layouts, strided input, into a slice, in place); the residual sum equals
    x + delta; the norm is within 2 ulps of eager (only the sum's order differs)."""
    from decode_server.model.fused_ops import rms_norm_eager
    from decode_server.model.rope import apply_rope_half_split, apply_rope_interleaved
    from kernels import norm_rope_triton as k

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 192, generator=gen) * 4
    angles = torch.rand(3, 32, generator=gen, dtype=torch.float64) * 100
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    for interleaved, ref in ((True, apply_rope_interleaved), (False, apply_rope_half_split)):
        want = ref(q[..., 128:], cos, sin)
        if not torch.equal(k.rope(q[..., 128:], cos, sin, interleaved), want):
            _fail(f"rope (interleaved={interleaved}) differs from eager")
        big = torch.zeros(3, 5, 576)
        k.rope(q[..., 128:], cos, sin, interleaved, out=big[..., 512:])
        if not torch.equal(big[..., 512:], want) or bool(big[..., :512].any()):
            _fail(f"rope into a slice (interleaved={interleaved}) is wrong")
        rows = q[:, 0, :].clone()  # [T, d] rows, rotated in place on their first 64 columns
        want_rows = ref(rows[:, :64], cos, sin)
        k.rope(rows[:, :64], cos, sin, interleaved, out=rows[:, :64])
        if not torch.equal(rows[:, :64], want_rows) or not torch.equal(rows[:, 64:], q[:, 0, 64:]):
            _fail(f"rope in place (interleaved={interleaved}) is wrong")
    for n in (100, 512, 1536):
        x = torch.randn(4, n, generator=gen) * 3
        delta = torch.randn(4, n, generator=gen)
        w = 1 + 0.1 * torch.randn(n, generator=gen)
        want = rms_norm_eager(x, w, 1e-6)
        got = k.rms_norm(x, w, 1e-6)
        tol = 2 * torch.finfo(torch.float32).eps * want.abs()
        if not bool(((got - want).abs() <= tol + 1e-30).all()):
            _fail(f"rms_norm (n={n}) off by {(got - want).abs().max().item()}")
        summed, normed = k.add_rms_norm(x, delta, w, 1e-6)
        if not torch.equal(summed, x + delta) or not torch.equal(normed, k.rms_norm(x + delta, w, 1e-6)):
            _fail(f"add_rms_norm (n={n}) is wrong")
        out = torch.zeros(4, n + 64)
        k.rms_norm(x, w, 1e-6, out=out[:, :n])
        if not torch.equal(out[:, :n], got) or bool(out[:, n:].any()):
            _fail(f"rms_norm into a slice (n={n}) is wrong")
    print("norm and rope kernels: rope exact, residual sums exact, norms within 2 ulps of eager")


def interpret_norm_quant() -> None:
    """The RMSNorm kernel's block-FP8 output (`quantize=True`, kernels/norm_rope_triton.py) under the interpreter:
    the normed values are the plain norm's, and the attached (e4m3 values, scales) equal what the quantization
    kernel (kernels/fp8_gemm_triton.quantize_activations) makes of those values, bit for bit — widths with a
    power-of-two and a padded register block (1536 → 2048), with and without the residual add, a zero row; an
    in-place write to the output voids the attachment; widths off the 128 grid are refused."""
    from kernels import norm_rope_triton as k
    from kernels.fp8_gemm import attached_quantized
    from kernels.fp8_gemm_triton import quantize_activations

    gen = torch.Generator().manual_seed(0)
    for n in (512, 1536):
        x = torch.randn(5, n, generator=gen) * 3
        x[2] = 0
        delta = torch.randn(5, n, generator=gen)
        w = 1 + 0.1 * torch.randn(n, generator=gen)
        plain = k.rms_norm(x, w, 1e-6)
        if attached_quantized(plain) is not None:
            _fail("a norm without quantize=True attached an FP8 form")
        for name, (normed, want_normed) in {
            "rms_norm": (k.rms_norm(x, w, 1e-6, quantize=True), plain),
            "add_rms_norm": (k.add_rms_norm(x, delta, w, 1e-6, quantize=True)[1], k.rms_norm(x + delta, w, 1e-6)),
        }.items():
            if not torch.equal(normed, want_normed):
                _fail(f"{name} (n={n}) with quantize=True changed the normed values")
            attached = attached_quantized(normed)
            if attached is None:
                _fail(f"{name} (n={n}): no FP8 form attached")
            q, scales = attached
            want_q, want_scales = quantize_activations(normed)
            if not (torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)):
                _fail(f"{name} (n={n}): the attached FP8 form differs from quantize_activations' bits")
        normed = k.rms_norm(x, w, 1e-6, quantize=True)
        normed.mul_(2)
        if attached_quantized(normed) is not None:
            _fail("an in-place write to the normed rows left their FP8 form attached")
    try:
        k.rms_norm(torch.randn(2, 100), torch.ones(100), 1e-6, quantize=True)
        _fail("a 100-wide norm accepted quantize=True")
    except ValueError:
        pass
    print("norm with FP8 output: normed values unchanged, FP8 form equal to the quantization kernel's bits")


def interpret_moe_route() -> None:
    """The router's selection kernel (kernels/moe_route_triton.py) against `route_tokens` on random logits: the
    same expert ids in the same order, weights within float32 rounding; the tie rule (lower index first) where
    every score is equal or groups tie."""
    from decode_server.model.moe import route_tokens
    from kernels import moe_route_triton as k

    gen = torch.Generator().manual_seed(0)
    for experts, groups, kept, top_k, normalize in ((256, 8, 4, 8, True), (8, 4, 2, 2, True), (64, 1, 1, 6, False),
                                                     (32, 4, 2, 8, True), (16, 16, 4, 3, False)):
        logits = torch.randn(5, experts, generator=gen) * 2
        bias = torch.randn(experts, generator=gen) * 0.1
        want_w, want_ids = route_tokens(logits, bias, groups, kept, top_k, normalize, 2.5)
        got_w, got_ids = k.route(logits, bias, groups, kept, top_k, normalize, 2.5)
        if not torch.equal(got_ids, want_ids):
            _fail(f"expert ids differ from route_tokens ({experts} experts, {groups} groups)")
        if not torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7):
            _fail(f"weights off by {(got_w - want_w).abs().max().item()} ({experts} experts, {groups} groups)")
    logits, bias = torch.zeros(2, 256), torch.zeros(256)
    _, ids = k.route(logits, bias, 8, 4, 8, True, 1.0)
    if ids.tolist() != [list(range(8))] * 2:
        _fail(f"ties: expected experts 0-7, got {ids[0].tolist()}")
    logits[:, 40] = 3.0
    logits[:, 200] = 3.0
    _, ids = k.route(logits, bias, 8, 4, 8, True, 1.0)
    if ids[0, :2].tolist() != [40, 200] or set(ids[0, 2:].tolist()) != {0, 1, 2, 3, 4, 5}:
        _fail(f"group ties: got {ids[0].tolist()}")
    print("router kernel: ids equal to route_tokens, weights within float32 rounding, ties to the lower index")


def interpret_moe_dispatch() -> None:
    """The MoE's one-kernel dispatch and combine (kernels/moe_dispatch_triton.py) against the eager path of
    `MoE.routed_grouped`: the dispatch's rows, their order and the end offsets equal the stable sort's (ties
    between tokens choosing one expert, other ranks' sentinel ids sorting last, experts nobody chose); the combine
    equals a float32 sum in expert-slot order bit for bit and eager's sum within float32 rounding, with and without
    the shared experts' output added."""
    from decode_server.model.moe import expert_end_offsets
    from kernels import moe_dispatch_triton as k

    gen = torch.Generator().manual_seed(0)
    cases = [(1, 8, 256, None), (5, 8, 16, None), (7, 3, 4, None), (6, 4, 8, 3)]  # (tokens, top_k, experts, EP cut)
    for tokens, top_k, experts, cut in cases:
        scores = torch.rand(tokens, experts, generator=gen)
        ids = scores.topk(top_k, dim=-1).indices
        if experts <= 8:  # many tokens on one expert: the stable order decides
            ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        local = experts
        if cut is not None:  # expert parallel: ids ≥ cut are other ranks' (sentinel `cut`)
            ids = torch.where(ids < cut, ids, cut)
            local = cut
        x = torch.randn(tokens, 300, generator=gen).to(torch.bfloat16)
        xs, slot, ends = k.dispatch(x, ids, local)
        sorted_ids, order = torch.sort(ids.flatten(), stable=True)
        if not torch.equal(ends, expert_end_offsets(sorted_ids, local)):
            _fail(f"end offsets differ from the sort's ({tokens} tokens, top-{top_k}, {experts} experts)")
        if not torch.equal(xs, x[order // top_k]) or not torch.equal(order[slot.long()], torch.arange(ids.numel())):
            _fail(f"dispatched rows differ from the sort's ({tokens} tokens, top-{top_k}, {experts} experts)")
        ys = torch.randn(ids.numel(), 300, generator=gen)
        weights = torch.rand(tokens, top_k, generator=gen)
        shared = torch.randn(tokens, 300, generator=gen).to(torch.bfloat16)
        owned = (ids < local).unsqueeze(-1)
        per_choice = torch.where(owned, ys[slot.long()].view(tokens, top_k, -1), 0.0) * weights.unsqueeze(-1)
        ordered = torch.zeros(tokens, 300)
        for j in range(top_k):
            ordered += per_choice[:, j]
        got = k.combine(ys, slot, ids, weights, local, out_dtype=torch.float32)
        if not torch.equal(got, ordered):
            _fail(f"combine differs from the float32 sum in slot order by {(got - ordered).abs().max()}")
        if not torch.allclose(got, per_choice.sum(dim=1), rtol=1e-6, atol=1e-6):
            _fail("combine differs from eager's sum beyond float32 rounding")
        # float32 here: the interpreter casts float32 to bf16 by truncation (the GPU rounds: its test checks bf16).
        with_shared = k.combine(ys, slot, ids, weights, local, shared=shared.float(), out_dtype=torch.float32)
        if not torch.equal(with_shared, ordered + shared.float()):
            _fail("combine with the shared experts differs from eager's add")
        if cut is not None:
            continue
        # Shared-experts fusion: each token's extra last choice is expert `local` (the stack's last), derived by the
        # kernel; rows, order and offsets are the sort's of the ids with that column appended, and the combine adds
        # the shared row of ys where it added `shared`.
        extended = torch.cat([ids, torch.full((tokens, 1), local)], dim=1)
        xs, slot, ends = k.dispatch(x, ids, local + 1, shared_expert=True)
        sorted_ids, order = torch.sort(extended.flatten(), stable=True)
        if not torch.equal(ends, expert_end_offsets(sorted_ids, local + 1)):
            _fail(f"shared-expert dispatch: end offsets differ from the sort's ({tokens} tokens, top-{top_k})")
        if not torch.equal(xs, x[order // (top_k + 1)]) or not torch.equal(order[slot.long()],
                                                                             torch.arange(extended.numel())):
            _fail(f"shared-expert dispatch: rows differ from the sort's ({tokens} tokens, top-{top_k})")
        ys = torch.randn(extended.numel(), 300, generator=gen)
        rows = ys[slot.long()].view(tokens, top_k + 1, -1)
        ordered = torch.zeros(tokens, 300)
        for j in range(top_k):
            ordered += rows[:, j] * weights[:, j : j + 1]
        got = k.combine(ys, slot, ids, weights, local + 1, out_dtype=torch.float32, shared_in_ys=True)
        if not torch.equal(got, ordered + rows[:, top_k]):
            _fail("combine with the shared expert's rows differs from the float32 sum plus its row")
    print("MoE dispatch: the stable sort's rows, order and offsets (with a fused shared expert too); combine: "
          "slot-order float32 sum, eager's add")


def interpret_fp8_quant() -> None:
    """The one-kernel FP8 quantizations (kernels/fp8_quant_triton.py) under the interpreter: the power-of-two
    scales equal eager's bit for bit (random rows, away from the powers of two where only CUDA's own log2f — the
    GPU path, not the interpreter's numpy — decides) at their place in the 656-byte row; a zero tile stays zero.
    The interpreter's float→e4m3 cast is not the GPU's (it rounds 124.0 to 64.0 and 100.0 to 104.0) and its bf16
    cast truncates, so the FP8 values and the RoPE bytes are held to eager's on the GPU only
    (tests/model/test_fused_ops_gpu.py); here the RoPE part must be its input within one bf16 step."""
    from kernels import fp8_quant_triton as k
    from kernels.fp8_rows import NOPE_DIM, ROPE_OFFSET, SCALE_OFFSET, pack_fp8_rows, unpack_fp8_rows
    from kernels.indexer_ref import quantize_index_keys

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(9, 128, generator=gen) * 3
    keys[3] = 0
    q, scales = k.quantize_index_keys(keys)
    _, want_scales = quantize_index_keys(keys)
    if not torch.equal(scales, want_scales) or q.shape != keys.shape or q.dtype != torch.float8_e4m3fn:
        _fail("index key scales differ from eager")
    rows = torch.randn(7, 576, generator=gen) * 2
    rows[2, :128] = 0  # a zero tile: the 1e-4 floor
    got, want = k.pack_fp8_rows(rows), pack_fp8_rows(rows)
    if got.shape != want.shape or not torch.equal(got[:, SCALE_OFFSET:ROPE_OFFSET], want[:, SCALE_OFFSET:ROPE_OFFSET]):
        _fail("FP8 row scales differ from eager")
    rope, want_rope = unpack_fp8_rows(got)[:, NOPE_DIM:], unpack_fp8_rows(want)[:, NOPE_DIM:]
    if not bool(((rope - want_rope).abs() <= 2**-7 * want_rope.abs()).all()):  # the interpreter truncates to bf16
        _fail("FP8 rows' RoPE part is not the input in bf16")
    if not torch.equal(unpack_fp8_rows(got)[2, :128], torch.zeros(128)):
        _fail("a zero tile does not stay zero")
    print("fp8 quantization kernels: scales equal to eager, the RoPE part within one bf16 step")


def interpret_indexer_rotation() -> None:
    """The indexer's query and key chains (kernels/indexer_rotation_triton.py) under the interpreter against
    eager (`fused_ops.rotate_index_heads`, `quantize_query`, `quantize_index_keys`): the rotated float query and
    its weights bit for bit, the e4m3 query's bytes and weights bit for bit, for bf16 and float32 inputs, both pair
    layouts, 8 and 64 heads; the keys' scales bit for bit (their e4m3 values go through the interpreter's own
    float → e4m3 cast, which is not the GPU's — it rounds 124.0 to 64.0 —, so the GPU tests hold those bytes; the
    rotation before them is the query's, checked bit for bit here). The fast transform itself: within float32
    rounding of the Hadamard matrix's product."""
    from decode_server.model.fused_ops import rotate_index_heads
    from decode_server.model.indexer import hadamard_matrix
    from kernels import indexer_rotation_triton as k
    from kernels.indexer_fast import quantize_query
    from kernels.indexer_ref import quantize_index_keys, walsh_hadamard

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 128, generator=gen) * 5
    err = (walsh_hadamard(x).double() - x.double() @ hadamard_matrix(128).double()).abs().max().item()
    if err > 1e-5:
        _fail(f"walsh_hadamard is {err:.1e} from the matrix product")
    tokens = 5
    angles = torch.rand(tokens, 32, generator=gen, dtype=torch.float64) * 100
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    for heads in (8, 64):
        for dtype in (torch.bfloat16, torch.float32):
            q = (torch.randn(tokens, heads, 128, generator=gen) * 3).to(dtype)
            w = torch.randn(tokens, heads, generator=gen)
            for interleaved in (False, True):
                want = rotate_index_heads(q, cos, sin, 64, interleaved)
                got, got_w = k.index_query(q, cos, sin, interleaved, w, 0.3, quantize=False)
                if not torch.equal(got, want) or not torch.equal(got_w, w * 0.3):
                    _fail(f"index_query H {heads} {dtype} interleaved={interleaved}: float query differs from eager")
                want8, want_w8 = quantize_query(want, w, 0.3)
                got8, got_w8 = k.index_query(q, cos, sin, interleaved, w, 0.3, quantize=True)
                if not torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)) or not torch.equal(got_w8, want_w8):
                    _fail(f"index_query H {heads} {dtype} interleaved={interleaved}: e4m3 query differs")
    for interleaved in (False, True):
        keys_in = torch.randn(tokens, 128, generator=gen) * 2
        want_keys, want_scales = quantize_index_keys(rotate_index_heads(keys_in, cos, sin, 64, interleaved))
        got_keys, got_scales = k.index_keys(keys_in, cos, sin, interleaved)
        if got_keys.dtype != torch.float8_e4m3fn or not torch.equal(got_scales, want_scales):
            _fail(f"index_keys interleaved={interleaved}: scales differ from eager")
    print("indexer rotation kernels: float and e4m3 queries equal to eager, keys' scales equal")


def _ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between got and want in units in the last place of their dtype (±0 equal)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    sign = 1 << (torch.finfo(want.dtype).bits - 1)

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bit patterns → integers in the values' order
        b = x.contiguous().view(bits).long() & ((sign << 1) - 1)
        return torch.where(b >= sign, sign - b, b)

    return int((ordered(got) - ordered(want)).abs().max())


def _interpreted_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU kernel's operations as the interpreter runs them: NumPy's float32 exp, an IEEE divide, the
    interpreter's float32 → bf16 cast (it truncates; the GPU rounds to nearest even) or NumPy's → fp16 cast."""
    import numpy as np

    def to_dtype(x: torch.Tensor) -> torch.Tensor:
        if gate.dtype != torch.bfloat16:
            return x.to(gate.dtype)
        return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are 0

    x = gate.float().numpy()
    with np.errstate(over="ignore"):
        silu = torch.from_numpy(np.divide(x, np.float32(1) + np.exp(-x)))
    return to_dtype(to_dtype(silu).float() * up.float())


def interpret_swiglu() -> None:
    """SwiGLU's one-kernel silu(gate) · up (kernels/swiglu_triton.py) under the interpreter, float32 / bf16 /
    fp16, rows not a multiple of the kernel's block, strided rows (column slices of the stacked gate/up output),
    1-D and 3-D inputs, values from -100 to 100: bit for bit the emulation of its operations in the interpreter's
    arithmetic (`_interpreted_silu_mul`: the order exp, 1 + e, divide, round, product, round), and within 4 ulps of
    eager `F.silu(g) * u`. Not eager's bits here: the interpreter has no libdevice, so its exp is NumPy's (up to
    ~2.3 ulps from the true value in float32, measured) and eager's here the CPU's, neither CUDA's expf that the
    GPU test holds the kernel to bit for bit; a silu one ulp off moves the product, and the interpreter truncates
    to bf16 where the GPU rounds. (On 1.3M random float32 values the distance from eager reached 5 ulps; on these
    seeded inputs it is at most 3.)"""
    import numpy as np
    import torch.nn.functional as F

    from kernels import swiglu_triton as k

    gen = torch.Generator().manual_seed(0)
    worst = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in [(3, 300), (2, 2 * k.BLOCK + 5), (1, 64), (5,), (2, 3, 100)]:
            both = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 8).to(dtype)
            gate, up = both[..., : shape[-1]], both[..., shape[-1] :]  # strided rows, as the stacked GEMM gives
            gate[(0,) * (gate.dim() - 1)][:4] = torch.tensor([-100.0, 100.0, -20.0, 0.0], dtype=dtype)
            with np.errstate(over="ignore"):  # exp(100) overflows to inf, as on the GPU: silu(-100) = -0
                got = k.silu_mul(gate, up)
            want = F.silu(gate) * up
            if got.shape != want.shape or got.dtype != want.dtype or not got.is_contiguous():
                _fail(f"silu_mul {dtype} {shape}: {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
            if not torch.equal(got, _interpreted_silu_mul(gate, up)):
                _fail(f"silu_mul {dtype} {shape}: differs from the emulation of its operations")
            ulps = _ulps(got, want)
            if ulps > 4:
                _fail(f"silu_mul {dtype} {shape}: {ulps} ulps from eager")
            worst[dtype] = max(worst.get(dtype, 0), ulps)
    print("swiglu kernel: its operations' bits; " + ", ".join(f"{u} ulps ({d})" for d, u in worst.items())
          + " from eager")


def compile_small_kernels() -> None:
    """The norm, rotation, router and FP8 quantization kernels (the indexer query's too) compile for sm_90 at the shapes the model launches,
    without spills."""
    from kernels.fp8_quant_triton import _index_keys_kernel, _pack_rows_kernel
    from kernels.indexer_fast import _quantize_query_kernel
    from kernels.indexer_rotation_triton import _index_keys_kernel as _rotate_keys_kernel
    from kernels.indexer_rotation_triton import _index_query_kernel
    from kernels.moe_route_triton import _route_kernel
    from kernels.norm_rope_triton import _rms_norm_kernel, _rms_norm_quant_kernel, _rope_kernel

    t0 = time.time()
    route_types = {"logits_ptr": "*fp32", "logits_stride": "i32", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                   "ids_ptr": "*i64", "num_experts": "i32", "scaling": "fp32"}
    norm_types = {"x_ptr": "*bf16", "x_stride": "i32", "d_ptr": "*bf16", "d_stride": "i32", "sum_ptr": "*bf16",
                  "sum_stride": "i32", "w_ptr": "*bf16", "out_ptr": "*bf16", "out_stride": "i32", "n": "i32",
                  "eps": "fp32"}
    norm_quant_types = {**norm_types, "q_ptr": "*fp8e4nv", "q_stride": "i32", "s_ptr": "*fp32", "s_stride": "i32"}
    rope_types = {"x_ptr": "*bf16", "x_tok_stride": "i32", "x_head_stride": "i32", "cos_ptr": "*bf16",
                  "sin_ptr": "*bf16", "cs_stride": "i32", "out_ptr": "*bf16", "out_tok_stride": "i32",
                  "out_head_stride": "i32", "heads": "i32"}
    builds = {
        "router 256 experts": (_route_kernel, route_types, {"N_GROUP": 8, "GROUP_SIZE": 32, "TOPK_GROUP": 4,
                                                            "TOP_K": 8, "TOP_K_BLOCK": 8, "NORMALIZE": True}, 4),
        "residual add + norm 7168": (_rms_norm_kernel, norm_types, {"HAS_DELTA": True, "BLOCK": 8192}, 16),
        "residual add + norm 7168, FP8 output": (_rms_norm_quant_kernel, norm_quant_types,
                                                 {"HAS_DELTA": True, "BLOCK": 8192, "PART_GROUPS": 8}, 16),
        "norm 1536, FP8 output": (_rms_norm_quant_kernel, norm_quant_types,
                                  {"HAS_DELTA": False, "BLOCK": 2048, "PART_GROUPS": 8}, 4),
        "rope 128 heads": (_rope_kernel, rope_types, {"INTERLEAVED": True, "HALF": 32, "HEADS_BLOCK": 16}, 4),
        "index key quantization": (_index_keys_kernel, {"x_ptr": "*fp32", "x_stride": "i32", "q_ptr": "*fp8e4nv",
                                                        "scale_ptr": "*fp32"}, {"DIM": 128, "LIBDEVICE": True}, 1),
        "index query quantization, 16 heads a program": (_quantize_query_kernel, {
            "q_ptr": "*fp32", "w_ptr": "*fp32", "q_out_ptr": "*u8", "w_out_ptr": "*fp32", "stride_qt": "i32",
            "stride_qh": "i32", "stride_wt": "i32", "num_heads": "i32", "weight_scale": "fp32"}, {"HEADS_BLOCK": 16}, 4),
        "indexer query chain, 16 heads a program, e4m3": (_index_query_kernel, {
            "q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "cs_stride": "i32", "w_ptr": "*fp32", "stride_wt": "i32", "q_out_ptr": "*u8", "w_out_ptr": "*fp32",
            "num_heads": "i32", "weight_scale": "fp32"}, {"HEADS_BLOCK": 16, "INTERLEAVED": False, "QUANTIZE": True}, 4),
        "indexer key chain": (_rotate_keys_kernel, {
            "k_ptr": "*fp32", "stride_kt": "i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "cs_stride": "i32",
            "keys_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}, {"INTERLEAVED": True, "LIBDEVICE": True}, 1),
        "FP8 row packing": (_pack_rows_kernel, {"x_ptr": "*bf16", "x_stride": "i32", "out_ptr": "*u8"},
                            {"TILES": 4, "TILE_": 128, "ROPE": 64, "ROW_BYTES": 656, "SCALE_AT": 512,
                             "ROPE_AT": 528, "LIBDEVICE": True}, 4),
    }
    for name, (fn, types, constexprs, warps) in builds.items():
        kernel = _compile_sm90(fn, types, constexprs, [n for n in types if n.endswith("_ptr")], warps, 3)
        resources = _resources(kernel)
        if " 0 B spilled" not in resources and "spilled" in resources:
            _fail(f"{name} spills: {resources}")
        print(f"{name}: {resources}")
    print(f"compiled for sm_90 in {time.time() - t0:.0f} s")


def compile_swiglu() -> None:
    """The SwiGLU kernel compiled for sm_90 with its launch's options (bf16, the widths and strides of the model,
    multiples of 16): its PTX must hold what gives eager's bits (kernels/swiglu_triton.py) — CUDA's accurate expf
    (libdevice's sequence, recognized by its rounding constant 0fCB40007F and its round-down FMA, not a bare
    `ex2.approx` of x·log2(e)) without flushing subnormals (no `.ftz` FMA), IEEE divides (`div.rn.f32`, no
    `div.full` / `div.approx`), round-to-nearest casts to bf16 — loads and stores of 16 bytes, and no spills."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.swiglu_triton import BLOCK, _silu_mul_kernel

    t0 = time.time()
    names = _silu_mul_kernel.arg_names
    types = {"gate_ptr": "*bf16", "gate_stride": "i32", "up_ptr": "*bf16", "up_stride": "i32", "out_ptr": "*bf16",
             "n": "i32"}
    src = ASTSource(fn=_silu_mul_kernel, signature={name: types.get(name, "constexpr") for name in names},
                    constexprs={"BLOCK_": BLOCK, "LIBDEVICE": True},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in types})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False})
    ptx = kernel.asm["ptx"]
    if "0fCB40007F" not in ptx or "fma.rm.f32" not in ptx:
        _fail("no libdevice expf sequence in the PTX")
    if re.search(r"fma\.r[nmpz]\.ftz", ptx):
        _fail("libdevice compiled with subnormals flushed (enable_reflect_ftz)")
    if "div.rn.f32" not in ptx or "div.full" in ptx or "div.approx" in ptx:
        _fail("the silu divide is not IEEE round-to-nearest")
    if not re.search(r"cvt\.rn\.bf16(x2)?\.f32", ptx):
        _fail("no round-to-nearest cast to bf16")
    if "ld.global.v4.b32" not in ptx or "st.global.v4.b32" not in ptx:
        _fail("loads or stores are not 16 bytes wide")
    resources = _resources(kernel)
    if " 0 B spilled" not in resources and "spilled" in resources:
        _fail(f"swiglu spills: {resources}")
    print(f"swiglu: libdevice expf without ftz, div.rn, 16-byte accesses; {resources}; {time.time() - t0:.1f} s")


def interpret_sparse_mla() -> None:
    """The Triton sparse MLA decode kernel (the attention fallback where FlashMLA does not run) against the float
    reference, FP8 rows and float rows, one split and several (the combine kernel), the wide variant, skipped
    entries and a request with nothing selected (out 0, LSE +inf). In fp16: Triton 3.6's interpreter computes bf16
    dots wrongly (a 16×16 bf16 dot comes out ~1e10 off), so q and the float rows are fp16 here; on the GPU the
    kernel runs bf16 (tests/kernels/test_kernels_gpu.py)."""
    from kernels.dispatch import sparse_mla_decode_rows_ref
    from kernels.fp8_rows import pack_fp8_rows
    from kernels.sparse_mla_triton import sparse_mla_decode_triton

    gen = torch.Generator().manual_seed(5)
    batch, heads, top_k, pool_rows, scale = 3, 16, 64, 300, 576 ** -0.5
    rows = torch.randn(pool_rows, 576, generator=gen) * torch.rand(pool_rows, 1, generator=gen) * 4
    q = torch.randn(batch, heads, 576, generator=gen).half()
    indices = torch.randint(0, pool_rows, (batch, top_k), generator=gen, dtype=torch.int32)
    indices[0, 5:40:3] = -1
    indices[2] = -1
    base = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    for name, kv in (("fp8 rows", pack_fp8_rows(rows)), ("fp16 rows", rows.half())):
        ref_out, ref_lse = sparse_mla_decode_rows_ref(q, kv, indices, scale)
        variants = [("1 split", base | {"SPLITS": 1}), ("4 splits", base | {"SPLITS": 4})]
        if name == "fp16 rows":
            variants.append(("wide, 2 splits", base | {"SPLITS": 2, "WIDE": 1}))
        for label, config in variants:
            out, lse = sparse_mla_decode_triton(q, kv, indices, scale, config)
            err = float((out[:2].float() - ref_out[:2].float()).norm() / ref_out[:2].float().norm())
            lse_err = float((lse[:2] - ref_lse[:2]).abs().max())
            if err > 2e-3 or lse_err > 1e-4:
                _fail(f"sparse MLA {name}, {label}: output {err:.1e}, LSE {lse_err:.1e} from the reference")
            if out[2].abs().max() != 0 or not bool(torch.isinf(lse[2]).all()):
                _fail(f"sparse MLA {name}, {label}: a request with nothing selected must give 0 and LSE +inf")
            print(f"sparse MLA {name}, {label}: output {err:.1e}, LSE {lse_err:.1e} from the reference")


def _sparse_mla_signature(fp8: bool) -> tuple[dict[str, str], list[str]]:
    """Argument types of the sparse MLA kernels (Triton and Gluon share the signature) for FP8 or bf16 rows, and
    what a launch specializes as 16-divisible: pointers, and the ints that are multiples of 16 (656-byte rows: only
    the byte stride; 576-wide rows: all three views' strides)."""
    types = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "kv_f32_ptr": "*fp32" if fp8 else "*bf16",
             "kv_bf16_ptr": "*bf16", "idx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "stride_qb": "i32", "stride_qh": "i32",
             "stride_kv": "i32", "stride_f32": "i32", "stride_bf16": "i32", "stride_ib": "i32",
             "num_heads": "i32", "top_k": "i32", "scale_log2": "fp32"}
    aligned = [n for n in types if n.endswith("_ptr")] + ["stride_qb", "stride_qh", "stride_ib", "num_heads",
                                                          "top_k", "stride_kv"]
    if not fp8:
        aligned += ["stride_f32", "stride_bf16"]
    return types, aligned


def compile_sparse_mla_triton() -> None:
    """The Triton sparse MLA kernel in the configurations `default_config` gives a TP rank's 16 / 32 heads (the
    mma.sync path every GPU without wgmma runs), compiled for sm_90: no spills and at most 128 B of stack a thread.
    With 4 warps, 32 heads and FP8 rows kept 672 B of stack and ran 1.6-1.8x slower than with 8 (H200,
    benchmarks/results/sparse_mla_triton_warps_2026-11-28); bf16 rows at 32 heads keep 96 B with 4 warps and
    still run faster than with 8 there."""
    from kernels.sparse_mla_triton import _sparse_mla_decode_kernel as fn
    from kernels.sparse_mla_triton import default_config

    for fp8 in (True, False):
        types, aligned = _sparse_mla_signature(fp8)
        for heads in (16, 32):
            cfg = default_config(heads, fp8)
            constexprs = {"BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"], "TOKENS_PER_SPLIT": 2048,
                          "NUM_SPLITS": 1, "FP8": fp8, "ROPE_ALIGNED": fp8}
            kernel = _compile_sm90(fn, types, constexprs, aligned, cfg["num_warps"], cfg["num_stages"])
            resources = _resources(kernel)
            label = f"Triton sparse MLA {'FP8' if fp8 else 'bf16'} rows, {heads} heads, {cfg['num_warps']} warps"
            print(f"{label}: {resources}")
            stack = re.search(r"stack (\d+) B", resources)
            if " 0 B spilled" not in resources or stack is None or int(stack.group(1)) > 128:
                _fail(f"{label}: spills or keeps more than 128 B of stack ({resources})")


def compile_sparse_mla_gluon() -> None:
    """The Gluon sparse MLA kernel (kernels/sparse_mla_gluon.py) compiled for sm_90 as launches specialize it, both
    row formats, unsplit and split, 64-head programs and a TP rank's 16 / 32 heads padded to one: no register
    spills, shared memory within an SM's 227 KiB (FP8 fills it: q, one bf16 tile, two FP8 slots and P), and the
    wgmmas in the main loop (five QK and four PV issues, 52 HGMMA instructions a 64-row tile)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.sparse_mla_gluon import _sparse_mla_gluon_kernel as fn

    names = fn.arg_names
    for fp8 in (False, True):
        types, aligned = _sparse_mla_signature(fp8)
        for splits, pad_heads in ((1, False), (4, False), (1, True), (4, True)):
            constexprs = {"BLOCK_H": 64, "BLOCK_N": 64, "TOKENS_PER_SPLIT": 2048 // splits, "NUM_SPLITS": splits,
                          "FP8": fp8, "PAD_HEADS": pad_heads, "num_warps": 8}
            src = GluonASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in names},
                                 constexprs={(names.index(k),): v for k, v in constexprs.items()},
                                 attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            resources = _resources(kernel)
            ops = _main_loop_ops(kernel)
            label = (f"Gluon sparse MLA {'FP8' if fp8 else 'bf16'} rows, {splits} split(s)"
                     + (", heads padded to 64" if pad_heads else ""))
            print(f"{label}: {resources}; main loop {sum(ops.values())} instructions, HGMMA {ops['HGMMA']}")
            if " 0 B spilled" not in resources:
                _fail(f"{label}: spills registers ({resources})")
            if kernel.metadata.shared > 232448:
                _fail(f"{label}: {kernel.metadata.shared} B of shared memory, more than an SM has")
            if ops["HGMMA"] != 52 or ops["LDGSTS"] == 0:
                _fail(f"{label}: main loop has {ops['HGMMA']} HGMMA (want 52) and {ops['LDGSTS']} cp.async")


CHECKS = {
    "interpret-kth-key": interpret_kth_key,
    "interpret-sparse-mla": interpret_sparse_mla,
    "interpret-moe-route": interpret_moe_route,
    "interpret-moe-dispatch": interpret_moe_dispatch,
    "compile-small-kernels": compile_small_kernels,
    "interpret-fp8-quant": interpret_fp8_quant,
    "interpret-indexer-rotation": interpret_indexer_rotation,
    "interpret-swiglu": interpret_swiglu,
    "interpret-norm-quant": interpret_norm_quant,
    "compile-swiglu": compile_swiglu,
    "interpret-norm-rope": interpret_norm_rope,
    "interpret-topk": interpret_topk,
    "interpret-scores": interpret_scores,
    "compile-topk": compile_topk,
    "compile-gemv": compile_gemv,
    "compile-bmm": compile_bmm,
    "compile-sparse-mla-gluon": compile_sparse_mla_gluon,
    "compile-sparse-mla-triton": compile_sparse_mla_triton,
    **{f"compile-scores-{p}": (lambda p=p: compile_scores(p)) for p in ("fp16", "fp16x2", "fp8")},
    "compile-scores-fp8-e4m3-q": lambda: compile_scores("fp8", q_e4m3=True),
    "compile-scores-early": lambda: (compile_scores("fp8", q_e4m3=True, early=True), compile_write_index_rows()),
    "compile-scores-balanced": lambda: (compile_scores_balanced(False), compile_scores_balanced(True)),
}

if __name__ == "__main__":
    if MODE not in CHECKS:
        print(f"usage: {sys.argv[0]} {{{','.join(CHECKS)}}}")
        sys.exit(2)
    CHECKS[MODE]()
