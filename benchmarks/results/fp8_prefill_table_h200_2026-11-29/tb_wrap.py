# ruff: noqa  -- kept as it ran
import faulthandler, runpy, sys
faulthandler.dump_traceback_later(float(sys.argv[1]), repeat=True, file=sys.stderr)
sys.argv = ["benchmarks/bench_prefill.py"] + sys.argv[2:]
runpy.run_path("benchmarks/bench_prefill.py", run_name="__main__")
