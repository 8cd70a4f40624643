"""CPU check of `scores_paged.py` under Triton's interpreter: on a paged token table (random pages of 64
consecutive rows, a slice of a wider table as in the engine, partial last blocks, several queries of one
request, a 1-position request) the paged kernel gives the gather kernel's scores bit for bit (kernels/indexer_fast.py,
e4m3 query). And the paged kernel must only be given paged tables: on one whose rows are permuted within
each page the scores differ.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/indexer_paged_tma_2026-11-27/check_cpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

from kernels import triton_interpret

triton_interpret.enable()  # before triton is imported
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scores_paged import paged_scores  # noqa: E402

from kernels.indexer_fast import indexer_scores_fast, quantize_query  # noqa: E402
from kernels.indexer_ref import quantize_index_keys  # noqa: E402


def main() -> None:
    gen = torch.Generator().manual_seed(3)
    pages, page = 60, 64
    keys, scales = quantize_index_keys(torch.randn(pages * page, 128, generator=gen))
    width = 1100
    table = torch.stack([(torch.randperm(pages, generator=gen)[: -(-width // page)].repeat_interleave(page) * page
                          + torch.arange(page).repeat(-(-width // page)))[:width] for _ in range(3)]).to(torch.int32)
    token_rows = table[:, :1000]  # a slice, like the engine's
    token_req = torch.tensor([0, 1, 2, 0, 2])
    seq_lens = torch.tensor([1000, 517, 999, 1, 64])
    for heads in (8, 64):
        q = torch.randn(5, heads, 128, generator=gen) * 3
        w = torch.randn(5, heads, generator=gen)
        q8, w8 = quantize_query(q, w, 0.3)
        want = indexer_scores_fast(q8, w8, keys, scales, token_rows, token_req, seq_lens)
        got = paged_scores(q8, w8, keys, scales, token_rows, token_req, seq_lens)
        for t in range(5):
            n = int(seq_lens[t])
            if not torch.equal(got[t, :n], want[t, :n]):
                raise SystemExit(f"H {heads} query {t}: paged scores differ from the gather kernel's")
        print(f"H {heads}: paged == gather kernel, bit for bit, over {int(seq_lens.sum())} positions")
    # Not paged: each block starts on its page's first row but the other 63 are permuted within the page.
    inner = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(page - 1, generator=gen)])
    shuffled = token_rows[:, :960].reshape(3, -1, page)[:, :, inner].reshape(3, 960).contiguous()
    want = indexer_scores_fast(q8, w8, keys, scales, shuffled, token_req, seq_lens.clamp(max=960))
    got = paged_scores(q8, w8, keys, scales, shuffled, token_req, seq_lens.clamp(max=960))
    assert not torch.equal(got[0, :960], want[0, :960]), "a non-paged table must not give the same scores"
    print("ok")


if __name__ == "__main__":
    main()
