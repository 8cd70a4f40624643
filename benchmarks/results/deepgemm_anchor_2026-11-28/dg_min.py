# ruff: noqa  -- kept as it ran (from bench_tmp/), issue 23 item 1 anchor, 2026-11-28
import torch
import deep_gemm
print('sms', deep_gemm.get_num_sms(), flush=True)
B, L = 16, 32768
ctx = torch.full((B, 1), L, dtype=torch.int32, device='cuda')
meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, deep_gemm.get_num_sms())
torch.cuda.synchronize()
print('meta', meta.shape, meta[:4].tolist(), flush=True)
