// Top-k of the indexer scores: exact radix select, one 1024-thread block per row, the row read twice.
//
// Semantics: kernels/topk_ref.py (the GPU tests' oracle) — the k visible positions with the largest (order key,
// −position), in ascending position order; a row with n <= k visible positions gives 0..n−1 then −1. Design
// (docs/kernels.md "Top-k kernel"):
//   1. one pass over the row: a 4096-bin shared-memory histogram of the key's top 12 bits; a block-wide suffix
//      scan finds the bin b1 that holds the k-th largest key;
//   2. a second pass (from L2): positions whose bin is above b1 are selected (a bit in a shared-memory bitmap
//      of the row's positions); those in b1 are the candidates, kept in shared memory when they fit (else every
//      later step re-reads the row, filtering on b1: slower, same result);
//   3. two more histogram rounds over the candidates (bits 19..8, then 7..0) give the k-th key T exactly; every
//      candidate above T is selected, and the ties (key == T) too when all of them are needed; otherwise the
//      lowest positions among the ties are taken: ranked in a shared-memory list when there are few (<= 128,
//      candidates in shared memory), else by an ordered pass over the row (warp ballots, block prefix);
//   4. the bitmap is written out in position order (popcounts, one block prefix sum).
// Histograms and candidate lists use shared-memory atomics (their order is not defined), but every decision is
// a set defined by T and the tie rule, so the output is deterministic and equal to the reference's.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 4096;       // rounds 1 and 2: 12-bit digits (bits 31..20, 19..8)
constexpr int kLastBins = 256;    // round 3: bits 7..0
constexpr int kCandCap = 4096;    // candidates kept in shared memory
constexpr int kUnroll = 4;        // loads in flight per thread in a row pass
constexpr int kTieListCap = 128;  // ties at the threshold ranked in a list (more: an ordered pass over the row)
constexpr int kFixedSmemWords = kBins + 2 * kCandCap + kWarps + 8;

#define TK_CUDA_CHECK(expr)                                                                     \
  do {                                                                                          \
    cudaError_t err__ = (expr);                                                                 \
    TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__), " at " #expr); \
  } while (0)

// float → unsigned key with the float order: −0.0 gets +0.0's key, NaN the largest key (kernels/topk_ref.py).
__device__ __forceinline__ uint32_t order_key(float x) {
  const int32_t bits = __float_as_int(x);
  int32_t key = bits < 0 ? (bits ^ 0x7FFFFFFF) : bits;
  if (bits == INT32_MIN) key = 0;
  if ((bits & 0x7FFFFFFF) > 0x7F800000) key = 0x7FFFFFFF;
  return static_cast<uint32_t>(key) ^ 0x80000000u;
}

// Exclusive prefix sum of one value per thread over the block; *total gets the sum. Two barriers.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_sums[lane];
    int inc = s;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += up;
    }
    warp_sums[lane] = inc - s;
    if (lane == 31) *total = inc;
  }
  __syncthreads();
  return warp_sums[warp] + inclusive - value;
}

// The bin b of hist[0..bins) with #(digit > b) < rank <= #(digit >= b) (1 <= rank <= sum): out[0] = b,
// out[1] = #(digit > b). Bins are scanned from the top; each thread owns a run of bins.
__device__ __forceinline__ void select_bin(const int* hist, int bins, int rank, int* warp_sums, int* out) {
  const int per = (bins + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per;  // index in descending-bin order
  int local = 0;
  for (int r = first; r < first + per && r < bins; ++r) local += hist[bins - 1 - r];
  int total;
  int above = block_exclusive_scan(local, warp_sums, &total);
  for (int r = first; r < first + per && r < bins; ++r) {
    const int h = hist[bins - 1 - r];
    if (above < rank && above + h >= rank) {
      out[0] = bins - 1 - r;
      out[1] = above;
    }
    above += h;
  }
  __syncthreads();
}

// f(key, position) for every visible position of the row, kUnroll float4 loads in flight per thread.
template <typename F>
__device__ __forceinline__ void for_each_key(const float* row, int n, bool vec4, F&& f) {
  if (vec4) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int n4 = n >> 2;
    for (int base = threadIdx.x; base < n4; base += kThreads * kUnroll) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        if (i < n4) v[u] = row4[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        if (i < n4) {
          f(order_key(v[u].x), 4 * i);
          f(order_key(v[u].y), 4 * i + 1);
          f(order_key(v[u].z), 4 * i + 2);
          f(order_key(v[u].w), 4 * i + 3);
        }
      }
    }
    for (int i = 4 * n4 + threadIdx.x; i < n; i += kThreads) f(order_key(row[i]), i);
  } else {
    for (int base = threadIdx.x; base < n; base += kThreads * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        if (i < n) v[u] = row[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        if (i < n) f(order_key(v[u]), i);
      }
    }
  }
}

__device__ __forceinline__ void mark(uint32_t* bitmap, int pos) {
  atomicOr(&bitmap[pos >> 5], 1u << (pos & 31));
}

__global__ void __launch_bounds__(kThreads) topk_rows_kernel(const float* __restrict__ scores, int64_t stride_s,
                                                             const int64_t* __restrict__ lens,
                                                             int32_t* __restrict__ out, int64_t stride_o,
                                                             int width, int k, bool vec4) {
  extern __shared__ int smem[];
  int* hist = smem;                                                      // kBins
  uint32_t* cand_key = reinterpret_cast<uint32_t*>(smem + kBins);       // kCandCap
  int* cand_pos = smem + kBins + kCandCap;                               // kCandCap
  int* warp_sums = smem + kBins + 2 * kCandCap;                          // kWarps
  int* scalars = warp_sums + kWarps;                                     // 8
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(scalars + 8);          // ceil(width / 32)

  const int64_t row_index = blockIdx.x;
  const float* row = scores + row_index * stride_s;
  int32_t* out_row = out + row_index * stride_o;
  const int64_t len = lens[row_index];
  const int n = static_cast<int>(len < 0 ? 0 : (len > width ? width : len));
  if (n <= k) {
    for (int i = threadIdx.x; i < k; i += kThreads) out_row[i] = i < n ? i : -1;
    return;
  }
  const int words = (n + 31) >> 5;
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  for (int i = threadIdx.x; i < words; i += kThreads) bitmap[i] = 0u;
  if (threadIdx.x == 0) {
    scalars[2] = 0;  // candidates collected
    scalars[3] = 0;  // ties listed
  }
  __syncthreads();

  // 1. Histogram of the top 12 bits; the bin of the k-th largest key.
  for_each_key(row, n, vec4, [&](uint32_t key, int) { atomicAdd(&hist[key >> 20], 1); });
  __syncthreads();
  select_bin(hist, kBins, k, warp_sums, scalars);
  const uint32_t b1 = static_cast<uint32_t>(scalars[0]);
  int need = k - scalars[1];  // keys to take from bin b1 (>= 1)
  const int num_cand = hist[b1];
  const bool in_smem = num_cand <= kCandCap;

  // 2. Select the bins above b1; collect b1's candidates.
  for_each_key(row, n, vec4, [&](uint32_t key, int pos) {
    const uint32_t d = key >> 20;
    if (d > b1) {
      mark(bitmap, pos);
    } else if (d == b1 && in_smem) {
      const int slot = atomicAdd(&scalars[2], 1);
      cand_key[slot] = key;
      cand_pos[slot] = pos;
    }
  });
  __syncthreads();

  // f(key, position) for every candidate (key's top 12 bits == b1).
  auto for_each_cand = [&](auto&& f) {
    if (in_smem) {
      for (int i = threadIdx.x; i < num_cand; i += kThreads) f(cand_key[i], cand_pos[i]);
    } else {
      for_each_key(row, n, vec4, [&](uint32_t key, int pos) {
        if ((key >> 20) == b1) f(key, pos);
      });
    }
  };

  // 3. Bits 19..8, then 7..0, among the candidates: the k-th key T exactly.
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  for_each_cand([&](uint32_t key, int) { atomicAdd(&hist[(key >> 8) & 0xFFF], 1); });
  __syncthreads();
  select_bin(hist, kBins, need, warp_sums, scalars);
  const uint32_t b2 = static_cast<uint32_t>(scalars[0]);
  need -= scalars[1];
  const uint32_t prefix2 = (b1 << 12) | b2;  // key >> 8 of the keys still in the running
  for (int i = threadIdx.x; i < kLastBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  for_each_cand([&](uint32_t key, int) {
    if ((key >> 8) == prefix2) atomicAdd(&hist[key & 0xFF], 1);
  });
  __syncthreads();
  select_bin(hist, kLastBins, need, warp_sums, scalars);
  const uint32_t threshold = (prefix2 << 8) | static_cast<uint32_t>(scalars[0]);
  need -= scalars[1];  // ties (key == T) to take, lowest positions first
  const int ties = hist[scalars[0]];
  const bool all_ties = need == ties;
  // A few ties among the shared-memory candidates: rank them by position in a list (hist is free now).
  const bool tie_list = !all_ties && in_smem && ties <= kTieListCap;
  __syncthreads();
  for_each_cand([&](uint32_t key, int pos) {
    if (key > threshold || (all_ties && key == threshold)) {
      mark(bitmap, pos);
    } else if (tie_list && key == threshold) {
      hist[atomicAdd(&scalars[3], 1)] = pos;
    }
  });
  if (tie_list) {
    __syncthreads();
    if (threadIdx.x < ties) {
      const int pos = hist[threadIdx.x];
      int rank = 0;
      for (int u = 0; u < ties; ++u) rank += hist[u] < pos;
      if (rank < need) mark(bitmap, pos);
    }
  } else if (!all_ties) {
    // Ordered pass: the first `need` positions with key == T.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int taken = 0;
    for (int base = 0; base < n && taken < need; base += kThreads) {
      const int pos = base + threadIdx.x;
      const bool tie = pos < n && order_key(row[pos]) == threshold;
      const uint32_t ballot = __ballot_sync(0xffffffffu, tie);
      if (lane == 0) warp_sums[warp] = __popc(ballot);
      __syncthreads();
      int before = taken;
      int chunk_total = 0;
      for (int w = 0; w < kWarps; ++w) {
        const int c = warp_sums[w];
        if (w < warp) before += c;
        chunk_total += c;
      }
      before += __popc(ballot & ((1u << lane) - 1u));
      if (tie && before < need) mark(bitmap, pos);
      taken += chunk_total;
      __syncthreads();
    }
  }
  __syncthreads();

  // 4. The bitmap in position order.
  const int per = (words + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per;
  int count = 0;
  for (int w = first; w < first + per && w < words; ++w) count += __popc(bitmap[w]);
  int total;
  int slot = block_exclusive_scan(count, warp_sums, &total);
  for (int w = first; w < first + per && w < words; ++w) {
    uint32_t bits = bitmap[w];
    while (bits) {
      const int b = __ffs(bits) - 1;
      out_row[slot++] = (w << 5) + b;
      bits &= bits - 1;
    }
  }
}

int max_dynamic_smem(int device) {
  int value = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return value;
}

}  // namespace

// Widest row (in positions) the kernel takes on `device`: its bitmap must fit in shared memory.
int64_t topk_rows_max_width(int64_t device) {
  const int64_t words = max_dynamic_smem(static_cast<int>(device)) / 4 - kFixedSmemWords;
  return words > 0 ? words * 32 : 0;
}

// scores [T, L] float32 (unit inner stride), lens [T] int64 → [T, k] int32 positions (kernels/topk_ref.py).
torch::Tensor topk_rows(torch::Tensor scores, torch::Tensor lens, int64_t k) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == torch::kFloat && scores.dim() == 2 &&
                  scores.stride(1) == 1,
              "scores must be a float32 [T, L] CUDA tensor with unit inner stride");
  TORCH_CHECK(lens.is_cuda() && lens.scalar_type() == torch::kLong && lens.dim() == 1 &&
                  lens.size(0) == scores.size(0) && lens.is_contiguous(),
              "lens must be a contiguous int64 [T] CUDA tensor");
  TORCH_CHECK(lens.device() == scores.device(), "scores and lens must be on one device");
  TORCH_CHECK(k > 0 && k < (int64_t{1} << 30), "k must be positive");
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t rows = scores.size(0), width = scores.size(1);
  auto out = torch::empty({rows, k}, scores.options().dtype(torch::kInt));
  if (rows == 0) return out;
  // A literal message only: a formatted one (c10::str) thrown from this nvcc-compiled file crashed the process
  // on the device image (torch 2.11, CUDA 13), where a literal one raises RuntimeError as it should.
  TORCH_CHECK(width <= topk_rows_max_width(scores.get_device()),
              "row width is beyond the top-k kernel's bitmap (kernels/topk_cuda.max_width gives the limit)");
  const int64_t words = (width + 31) / 32;
  const size_t smem = static_cast<size_t>(kFixedSmemWords + words) * 4;
  TK_CUDA_CHECK(cudaFuncSetAttribute(topk_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  const bool vec4 = scores.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(scores.data_ptr()) % 16 == 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  topk_rows_kernel<<<static_cast<unsigned>(rows), kThreads, smem, stream>>>(
      scores.data_ptr<float>(), scores.stride(0), lens.data_ptr<int64_t>(), out.data_ptr<int32_t>(), out.stride(0),
      static_cast<int>(width), static_cast<int>(k), vec4);
  TK_CUDA_CHECK(cudaGetLastError());
  return out;
}
