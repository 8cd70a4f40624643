# ruff: noqa  -- kept as it ran
"""Device memory a model build leaves stranded (reserved but unallocated after gc + empty_cache), and the KV
budget the engine would plan, with the construction of HEAD (old) and of the tree (new)."""
import gc, hashlib, sys, time
import torch
sys.path.insert(0, "bench_tmp")
from decode_server.model import construct, build_random_model, load_config
from decode_server.engine import kv_sizing

config_name, impl = sys.argv[1], sys.argv[2]
if impl == "old":
    import construct_old
    construct.build_empty_model = construct_old.build_empty_model
cfg = load_config(config_name)
t = time.perf_counter()
model = build_random_model(cfg, "cuda", torch.bfloat16, seed=0, quantization="auto")
torch.cuda.synchronize()
build_s = time.perf_counter() - t
gc.collect(); torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info()
alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
h = hashlib.sha1()
for name, p in list(model.named_parameters())[::37]:
    h.update(name.encode()); h.update(p.detach().float().sum().cpu().numpy().tobytes())
budget = kv_sizing.kv_budget_from_memory(free, total, 0.85)
layers = model.model.layers
fused_in = sum(getattr(l.self_attn, "fused_inputs", None) is not None for l in layers)
print(f"RESULT {config_name:15s} {impl:3s} build {build_s:5.1f} s alloc {alloc/2**30:7.2f} GiB reserved "
      f"{reserved/2**30:7.2f} stranded {(reserved-alloc)/2**20:7.1f} MiB budget {budget/2**30:6.2f} GiB "
      f"fused_inputs {fused_in}/{len(layers)} hash {h.hexdigest()[:12]}")
