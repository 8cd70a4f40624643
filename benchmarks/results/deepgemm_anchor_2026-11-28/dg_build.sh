# Build DeepGEMM (source of github.com/deepseek-ai/DeepGEMM 54e2261, cutlass f3fde58, fmt 553ec11) on the device.
set -e
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(which nvcc)")")}
echo "CUDA_HOME $CUDA_HOME; $(nvcc --version | tail -2 | head -1)"
rm -rf /tmp/dgb && mkdir -p /tmp/dgb/build && tar -xzf bench_tmp/dg.tar.gz -C /tmp/dgb
cd /tmp/dgb/dg
python3 $OLDPWD/bench_tmp/dg_patch.py
cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass deep_gemm/include/
start=$(date +%s)
CXX=/usr/bin/g++ MAX_JOBS=16 python3 - > /tmp/dg_build.log 2>&1 <<'PY' || { tail -40 /tmp/dg_build.log; exit 1; }
import os, shutil, torch
from torch.utils.cpp_extension import CUDA_HOME, load
mod = load(name="_C", sources=["csrc/python_api.cpp"], build_directory="/tmp/dgb/build",
           extra_include_paths=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl", "deep_gemm/include",
                                "third-party/cutlass/include", "third-party/fmt/include"],
           extra_cflags=["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations"],
           extra_ldflags=[f"-L{CUDA_HOME}/lib64", "-lcudart", "-lnvrtc"], verbose=True)
shutil.copy(mod.__file__, "deep_gemm/_C" + os.path.splitext(mod.__file__)[1])
PY
echo "built in $(( $(date +%s) - start )) s: $(ls deep_gemm/*.so)"
