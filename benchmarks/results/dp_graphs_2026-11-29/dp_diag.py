"""Diagnose test_dp_graphs_gpu: run gpu_dp_graph_scenarios on 2 ranks with per-rank progress and stack dumps."""
import faulthandler
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path("tests") / s) for s in ("parallel", "model", "hisparse")]


def traced(rank: int, init_method: str, out_dir: str) -> None:
    import dp_workers
    faulthandler.dump_traceback_later(float(sys.argv[1]) if len(sys.argv) > 1 else 120, repeat=True)
    real_run, real_engine = dp_workers.run_engine, dp_workers.Engine
    t0 = time.monotonic()

    def run_engine(engine, arrivals, parallel):
        t = time.monotonic()
        print(f"[rank {rank}] {time.monotonic()-t0:.1f}s run_engine start", file=sys.stderr, flush=True)
        out = real_run(engine, arrivals, parallel)
        print(f"[rank {rank}] run_engine {time.monotonic()-t:.1f}s steps {out['steps']} idle {out['idle_passes']}",
              file=sys.stderr, flush=True)
        return out

    def engine(*a, **k):
        t = time.monotonic()
        e = real_engine(*a, **k)
        print(f"[rank {rank}] {time.monotonic()-t0:.1f}s Engine built in {time.monotonic()-t:.1f}s "
              f"graphs={e.graph_runner is not None} err={e.cuda_graph_error}", file=sys.stderr, flush=True)
        return e

    dp_workers.run_engine, dp_workers.Engine = run_engine, engine
    dp_workers.gpu_dp_graph_scenarios(rank, init_method, out_dir)
    print(f"[rank {rank}] done {time.monotonic()-t0:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from tp_workers import run_ranks

    from decode_server.model import resolve_model_path
    resolve_model_path("tiny-dsa")
    t = time.monotonic()
    res = run_ranks(traced, Path(tempfile.mkdtemp()), timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 300)
    print(f"all ranks done in {time.monotonic()-t:.1f}s", flush=True)
