"""FP8 weight bytes a batch-1 decode step reads, per kernel family, over the kernel time the step's profile gives
(bench_fp8_step.py's JSON, `top_kernels` of the FP8 run): the step-level form of issue 21's "≥ 70 % of HBM".
A family is every launch form of its projections' kernels: the dense one-row and tensor-core kernels, the grouped
per-expert and row-program one-row kernels and the tensor-core grouped kernel, the batched one-row and tensor-core
kernels (cuBLAS's block-scaled FP8 GEMMs, `qqtst`, are not expected at batch 1: the script says so if they ran).

At batch 1 the bytes are exact from the config: every FP8 projection of every layer once, the absorbed W_UK / W_UV
(128-head FP8 blocks), and per MoE layer the shared expert plus `num_experts_per_tok` distinct routed experts.
Block scales (4 B per 128×128 block) are added. Where the step JSON says the shared expert ran fused into the routed
experts' grouped GEMMs (`meta.shared_experts_fused`: that many MoE layers), its bytes count as grouped. The split-K
partial sums (`_splitk_sum_kernel`) of tensor-core kernels that split K are GEMM work and join the quantizations'
line. Usage: python benchmarks/fp8_step_gbps.py STEP.json [config.json]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def fp8_bytes(n: int, k: int) -> int:
    return n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)


def batch1_bytes(c: dict, shared_fused_layers: int = 0) -> dict[str, int]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    attention = (fp8_bytes(q_lora + kv_lora + rope + c["index_head_dim"], h)  # q_a + kv_a + wk, one GEMM
                 + fp8_bytes(heads * (nope + rope), q_lora) + fp8_bytes(h, heads * v)
                 + fp8_bytes(c["index_n_heads"] * c["index_head_dim"], q_lora))
    dense_mlp = fp8_bytes(2 * c["intermediate_size"], h) + fp8_bytes(h, c["intermediate_size"])
    inter = c["moe_intermediate_size"]
    shared = fp8_bytes(2 * inter * c["n_shared_experts"], h) + fp8_bytes(h, inter * c["n_shared_experts"])
    routed = c["num_experts_per_tok"] * (2 * fp8_bytes(inter, h) + fp8_bytes(h, inter))
    absorbed = heads * (fp8_bytes(kv_lora, nope) + fp8_bytes(v, kv_lora))
    moe_layers = layers - dense_layers
    fused = min(shared_fused_layers, moe_layers)
    return {"dense": layers * attention + dense_layers * dense_mlp + (moe_layers - fused) * shared,
            "grouped (routed experts)": moe_layers * routed + fused * shared,
            "batched (absorbed W_UK, W_UV)": layers * absorbed}


FAMILIES = {"dense": ("_fp8_gemv_kernel", "_fp8_gemm_kernel"), "grouped (routed experts)": ("_fp8_grouped_",),
            "batched (absorbed W_UK, W_UV)": ("_fp8_bmm",)}


def main() -> None:
    step = json.loads(Path(sys.argv[1]).read_text())
    root = Path(__file__).resolve().parents[1]
    config = json.loads(Path(sys.argv[2] if len(sys.argv) > 2 else root / "configs" / "dsv32-bench-16l.json")
                        .read_text())
    hbm = step["meta"]["hbm_copy_gbps"]
    row = next((r for r in step["rows"] if r["batch"] == 1), None)
    if row is None or "top_kernels" not in row.get("fp8_run", {}):
        reason = "no batch-1 row" if row is None else f"its FP8 run has no profile ({row['fp8_run'].get('error', '?')})"
        sys.exit(f"{sys.argv[1]}: {reason}")
    kernels = row["fp8_run"]["top_kernels"]
    fused = int(step["meta"].get("shared_experts_fused", 0))
    expected = batch1_bytes(config, fused)
    print(f"{step['meta']['device']}: HBM copy {hbm:.0f} GB/s; batch 1, FP8 step {row['fp8_run']['step_ms']:.3f} ms"
          + (f"; the shared expert fused in {fused} MoE layers" if fused else ""))
    total_bytes = total_us = 0.0
    for family, nbytes in expected.items():
        us = sum(t for name, t, _ in kernels if name.startswith(FAMILIES[family]))
        calls = sum(c for name, _, c in kernels if name.startswith(FAMILIES[family]))
        gbps = nbytes / (us * 1e-6) / 1e9
        total_bytes, total_us = total_bytes + nbytes, total_us + us
        print(f"  {family:<30} {nbytes / 1e6:8.1f} MB {us:8.1f} µs {calls:4.0f} calls {gbps:6.0f} GB/s "
              f"{100 * gbps / hbm:3.0f} %")
    if any("qqtst" in name for name, _, _ in kernels):
        print("  note: cuBLAS block-scaled FP8 GEMMs (qqtst) ran and are not counted above")
    quant_us = sum(t for name, t, _ in kernels if name.startswith(("_quantize_kernel", "_splitk_sum_kernel")))
    for label, us in (("the GEMM kernels", total_us), ("+ quantizations, split-K sums", total_us + quant_us)):
        gbps = total_bytes / (us * 1e-6) / 1e9
        print(f"  {label:<32} {total_bytes / 1e6:8.1f} MB {us:8.1f} µs {gbps:6.0f} GB/s {100 * gbps / hbm:3.0f} %")


if __name__ == "__main__":
    main()
