# ruff: noqa  -- kept as it ran
import sys
sys.path.insert(0, "bench_tmp"); sys.path.insert(0, "tests/model")
import construct_old
from decode_server.model import construct
import test_construct_memory_gpu as t
impl = sys.argv[1]
if impl == "old":
    construct.build_empty_model = construct_old.build_empty_model
for name in ("dsv32-rank-ep8", "glm5-rank-ep8"):
    print("RESULT", impl, name, [round(t.stranded_after_build(name, n) / 2**20, 2) for n in (4, 10, 16)], flush=True)
