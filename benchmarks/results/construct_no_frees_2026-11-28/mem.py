"""Device memory a random build of a rank config leaves stranded (reserved − allocated after gc + empty_cache), the
engine's KV budget then (mem_fraction_static 0.85) and a hash of every 37th tensor, with the tree's construction
("new") or the one in OLD_CONSTRUCT ("old": call.sh saves the tree's construct.py there before it applies the
patch). Also the first 16 layers (the GPU test's cut).

    OLD_CONSTRUCT=/tmp/construct_old.py python3 benchmarks/results/construct_no_frees_2026-11-28/mem.py CONFIG old|new
"""

import gc
import hashlib
import importlib.util
import os
import sys
import time

import torch

from decode_server.engine import kv_sizing
from decode_server.model import build_random_model, construct, load_config

config_name, impl = sys.argv[1], sys.argv[2]
if impl == "old":
    spec = importlib.util.spec_from_file_location("construct_old", os.environ["OLD_CONSTRUCT"])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    construct.build_empty_model = old.build_empty_model
sys.path.insert(0, "tests/model")
from test_construct_memory_gpu import LAYERS, stranded_after_build  # noqa: E402

cut = stranded_after_build(config_name, LAYERS)
start = time.perf_counter()
model = build_random_model(load_config(config_name), "cuda", torch.bfloat16, seed=0, quantization="auto")
torch.cuda.synchronize()
build_s = time.perf_counter() - start
gc.collect()
torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info()
allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
digest = hashlib.sha1()
for name, param in list(model.named_parameters())[::37]:
    digest.update(name.encode())
    digest.update(param.detach().float().sum().cpu().numpy().tobytes())
budget = kv_sizing.kv_budget_from_memory(free, total, 0.85)
print(f"RESULT {config_name:15s} {impl:3s} build {build_s:5.1f} s stranded {(reserved - allocated) / 2**20:7.1f} MiB "
      f"budget {budget / 2**30:6.2f} GiB; first {LAYERS} layers {cut / 2**20:6.1f} MiB; hash {digest.hexdigest()[:12]}")
