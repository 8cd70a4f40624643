// HiSparse CUDA kernels: swap-in (plan + copy) and the all-layer KV backup.
//
// Semantics: kernels/swap_in_ref.py (the oracle of the GPU tests) and docs/architecture.md "HiSparse memory
// layout". Design (docs/kernels.md):
//   * plan kernel, one 1024-thread block per request: fast path (identity placement), or the long path with
//     a shared-memory open-addressing hash of the selected tokens, a lookup of every buffer position's token,
//     a scan of the LRU order against those lookups and a block-wide prefix sum to compact hits and evictable
//     positions (both kept in LRU order), miss compaction in top-k order, slot assignment, LRU rewrite, and a
//     per-request miss plan (src, dst).
//   * copy kernel, a grid-stride over every miss of the batch (one warp per row, 16 B loads straight from
//     pinned host memory through its device-visible UVA address), so that a batch of one request still
//     keeps hundreds of rows in flight over PCIe.
//   * backup kernel: newest token's rows of all layers, device -> pinned host, one launch.
//   * copy_rows: the same row-copy kernel between any two pools, each on the device or in pinned host memory
//     (prefill staging: host -> device scratch and back, buffer preload), one launch per call.

#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kCopyThreads = 256;
constexpr int kEmpty = -1;

#define HS_CUDA_CHECK(expr)                                                                     \
  do {                                                                                          \
    cudaError_t err__ = (expr);                                                                 \
    TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__), " at " #expr); \
  } while (0)

// Fibonacci hashing: the product's high bits (shift = 32 - log2(table size)), so keys that differ only in their
// high bits, or share a stride, still spread over the table (the low bits of key * odd constant would not).
__device__ __forceinline__ uint32_t hash_index(int32_t key, uint32_t shift) {
  return (static_cast<uint32_t>(key) * 2654435761u) >> shift;
}

// Linear probing. The table is sized for a load factor of 1/8 where shared memory allows (plan_launch): a warp
// waits for its longest probe sequence, and at 1/2 that was ~8 probes per lookup (ncu, H200, B 64 hit-only: the
// probe loops were ~60 % of the kernel's instructions).
__device__ __forceinline__ void hash_insert(int* keys, int* vals, uint32_t mask, uint32_t shift, int key, int val) {
  uint32_t h = hash_index(key, shift);
  while (true) {
    const int prev = atomicCAS(&keys[h], kEmpty, key);
    if (prev == kEmpty || prev == key) {
      vals[h] = val;
      return;
    }
    h = (h + 1) & mask;
  }
}

__device__ __forceinline__ int hash_lookup(const int* keys, const int* vals, uint32_t mask, uint32_t shift, int key) {
  uint32_t h = hash_index(key, shift);
  while (true) {
    const int k = keys[h];
    if (k == key) return vals[h];
    if (k == kEmpty) return -1;
    h = (h + 1) & mask;
  }
}

// Exclusive prefix sum of `value` over the block's threads (thread order) and the block total. Every thread
// of the block must call it (it has barriers). s_warp: kPlanWarps ints of shared memory.
__device__ __forceinline__ int block_exclusive_sum(int value, int* s_warp, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int x = value;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += up;
  }
  if (lane == 31) s_warp[warp] = x;  // warp total
  __syncthreads();
  if (warp == 0) {
    int v = lane < kPlanWarps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += up;
    }
    if (lane < kPlanWarps) s_warp[lane] = v;  // inclusive prefix over warps
  }
  __syncthreads();
  const int before = (warp == 0 ? 0 : s_warp[warp - 1]) + x - value;
  *total = s_warp[kPlanWarps - 1];
  __syncthreads();  // s_warp is reused by the next call
  return before;
}

// Programmatic dependent launch (Hopper): the copy kernel is launched while the plan kernel still runs and
// waits here until the plan kernel's writes are visible; the plan kernel lets it launch right away.
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct PlanArgs {
  const int32_t* top_k;       // [B, K]
  const int64_t* seq_lens;    // [B]
  const int64_t* req_rows;    // [B]
  const int32_t* buffer_slots;  // [max_reqs, D + R], row stride slots_stride
  int32_t* buffer_tokens;     // [max_reqs, D], row stride tokens_stride
  int32_t* lru_order;         // [max_reqs, D], row stride lru_stride
  const int32_t* host_rows;   // [max_reqs, max_ctx], row stride host_rows_stride
  int32_t* out;               // [B, K]
  int32_t* plan_src;          // [B, K] host row of each miss, compacted
  int32_t* plan_dst;          // [B, K] device slot of each miss, compacted
  int32_t* miss_count;        // [B]
  unsigned long long* counters;  // [2] or nullptr
  int64_t slots_stride, tokens_stride, lru_stride, host_rows_stride;
  int K, D, R;
  uint32_t hash_mask;   // table size - 1 (a power of two)
  uint32_t hash_shift;  // 32 - log2(table size)
  bool vec4_rows;       // every request's rows of buffer_slots, buffer_tokens and lru_order start 16-byte aligned
                        // and D % 4 == 0: their runs load as int4
};

// out[e] = row[first + e] for first + e < D, else -1. Runs of N consecutive ints (N a multiple of 4 when
// vec4): with vec4 (16-byte aligned row, D % 4 == 0) an int4 is either wholly inside [0, D) or wholly outside.
// load_run reads through L1 (rows this kernel rewrites later); load_run_nc through the read-only path.
template <int N>
__device__ __forceinline__ void load_run(const int32_t* row, int first, int D, bool vec4, int (&out)[N]) {
  if (N % 4 == 0 && vec4) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      const int k = first + 4 * c;
      const int4 v = k < D ? *reinterpret_cast<const int4*>(row + k) : make_int4(-1, -1, -1, -1);
      out[4 * c] = v.x, out[4 * c + 1] = v.y, out[4 * c + 2] = v.z, out[4 * c + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = first + e < D ? row[first + e] : -1;
  }
}

template <int N>
__device__ __forceinline__ void load_run_nc(const int32_t* row, int first, int D, bool vec4, int (&out)[N]) {
  if (N % 4 == 0 && vec4) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      const int k = first + 4 * c;
      const int4 v = k < D ? __ldg(reinterpret_cast<const int4*>(row + k)) : make_int4(-1, -1, -1, -1);
      out[4 * c] = v.x, out[4 * c + 1] = v.y, out[4 * c + 2] = v.z, out[4 * c + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = first + e < D ? __ldg(row + first + e) : -1;
  }
}

// Thread t owns LRU ranks [t*D_ITEMS, (t+1)*D_ITEMS) and top-k entries [t*K_ITEMS, (t+1)*K_ITEMS): consecutive
// runs, so one block-wide prefix sum per phase keeps LRU order and top-k order, and all of a thread's global
// loads are issued before their first use.
template <int D_ITEMS, int K_ITEMS>
__global__ void __launch_bounds__(kPlanThreads, 1) swap_in_plan_kernel(PlanArgs a) {
  extern __shared__ __align__(16) int smem[];
  __shared__ int s_warp[kPlanWarps];
  __shared__ int s_ring_hits;
  allow_dependent_launch();
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int K = a.K, D = a.D, R = a.R;
  const int64_t row = __ldg(a.req_rows + b);
  const int64_t n = __ldg(a.seq_lens + b);
  // Distinct arrays: __restrict__ lets the compiler keep independent loads in flight across the stores.
  const int32_t* __restrict__ tk = a.top_k + static_cast<int64_t>(b) * K;
  int32_t* __restrict__ o = a.out + static_cast<int64_t>(b) * K;
  const int32_t* __restrict__ slots = a.buffer_slots + row * a.slots_stride;
  if (tid == 0) s_ring_hits = 0;

  if (n <= D) {  // fast path: token t sits at LRU position t
    int t[K_ITEMS];
    int slot[K_ITEMS];
#pragma unroll
    for (int e = 0; e < K_ITEMS; ++e) {
      const int i = tid + e * kPlanThreads;
      t[e] = i < K ? __ldg(tk + i) : -1;
    }
    int valid = 0;
#pragma unroll
    for (int e = 0; e < K_ITEMS; ++e) {
      slot[e] = t[e] >= 0 ? __ldg(slots + t[e]) : -1;
      valid += t[e] >= 0;
    }
#pragma unroll
    for (int e = 0; e < K_ITEMS; ++e) {
      const int i = tid + e * kPlanThreads;
      if (i < K) o[i] = slot[e];
    }
    __syncthreads();
    if (valid) atomicAdd(&s_ring_hits, valid);
    __syncthreads();
    if (tid == 0) {
      a.miss_count[b] = 0;
      if (a.counters != nullptr && s_ring_hits) {
        atomicAdd(&a.counters[0], static_cast<unsigned long long>(s_ring_hits));
      }
    }
    return;
  }

  const int hash_size = static_cast<int>(a.hash_mask) + 1;
  int* s_keys = smem;                 // hash_size
  int* s_vals = s_keys + hash_size;   // hash_size
  int* s_state = s_vals + hash_size;  // K: 1 = resolved (padding, ring or table hit), 0 = miss
  int* s_evict = s_state + K;         // D: evictable positions, LRU order (phase 2b on)
  int* s_hit_of = s_evict;            // D: per buffer position, its top-k index or -1 (phase 2a; dead before
                                      //    s_evict's first write, which follows phase 2b's prefix-sum barrier)
  int* s_hits = s_evict + D;          // K: hit positions, LRU order
  int32_t* __restrict__ tokens = a.buffer_tokens + row * a.tokens_stride;
  int32_t* __restrict__ lru = a.lru_order + row * a.lru_stride;
  const int32_t* __restrict__ hrows = a.host_rows + row * a.host_rows_stride;

  // Issue this thread's global loads first: top-k entries, then its runs of LRU ranks and of buffer positions
  // (their tokens and slots). All D-long reads are contiguous runs (16-byte loads where aligned): the LRU walk
  // below gathers by position from shared memory, not from global memory (docs/kernels.md).
  int tok[K_ITEMS];
#pragma unroll
  for (int e = 0; e < K_ITEMS; ++e) {
    const int i = tid * K_ITEMS + e;
    tok[e] = i < K ? __ldg(tk + i) : -1;
  }
  const int first_item = tid * D_ITEMS;
  int pos[D_ITEMS];   // LRU ranks first_item + e: the buffer position each holds
  int held[D_ITEMS];  // buffer positions first_item + e: the token each holds
  // Buffer positions first_item + e: their device slots, loaded up front up to 8 items a thread; at 16 the
  // registers run out (spills), so those instances load a hit's slot when they find it.
  constexpr bool kEagerSlots = D_ITEMS <= 8;
  int pslot[kEagerSlots ? D_ITEMS : 1];
  load_run<D_ITEMS>(lru, first_item, D, a.vec4_rows, pos);
  load_run<D_ITEMS>(tokens, first_item, D, a.vec4_rows, held);
  if constexpr (kEagerSlots) load_run_nc<D_ITEMS>(slots, first_item, D, a.vec4_rows, pslot);
  {  // the table size is a power of two >= 128 (plan_launch), so whole int4 stores cover it
    int4* keys4 = reinterpret_cast<int4*>(s_keys);
    const int4 empty4 = make_int4(kEmpty, kEmpty, kEmpty, kEmpty);
    for (int j = tid; j < hash_size / 4; j += kPlanThreads) keys4[j] = empty4;
  }
  int ring_slot[K_ITEMS];
#pragma unroll
  for (int e = 0; e < K_ITEMS; ++e) {
    const int t = tok[e];
    ring_slot[e] = (t >= D && static_cast<int64_t>(t) >= n - R) ? __ldg(slots + D + t % R) : -1;
  }
  __syncthreads();

  // 1. Classify the selected tokens: padding, recent-ring hits, or candidates for the LRU table.
  int ring = 0;
#pragma unroll
  for (int e = 0; e < K_ITEMS; ++e) {
    const int i = tid * K_ITEMS + e;
    if (i >= K) continue;
    const int t = tok[e];
    int resolved = 1;
    if (t < 0) {
      o[i] = -1;
    } else if (ring_slot[e] >= 0) {
      o[i] = ring_slot[e];
      ++ring;
    } else {
      resolved = 0;
      hash_insert(s_keys, s_vals, a.hash_mask, a.hash_shift, t, i);
    }
    s_state[i] = resolved;
  }
  if (ring) atomicAdd(&s_ring_hits, ring);
  __syncthreads();

  // 2a. Per buffer position: a held token that is selected is a hit; its slot goes to the output.
#pragma unroll
  for (int e = 0; e < D_ITEMS; ++e) {
    const int p = first_item + e;
    if (p >= D) continue;
    const int h = held[e] >= 0 ? hash_lookup(s_keys, s_vals, a.hash_mask, a.hash_shift, held[e]) : -1;
    s_hit_of[p] = h;
    if (h >= 0) {
      if constexpr (kEagerSlots) {
        o[h] = pslot[e];
      } else {
        o[h] = __ldg(slots + p);
      }
      s_state[h] = 1;
    }
  }
  __syncthreads();

  // 2b. LRU walk: each rank's position is a hit or evictable. One prefix sum of (hits | evictable << 16) places
  //     both lists in LRU order.
  bool is_hit[D_ITEMS];
  int my_hits = 0, my_evict = 0;
#pragma unroll
  for (int e = 0; e < D_ITEMS; ++e) {
    is_hit[e] = pos[e] >= 0 && s_hit_of[pos[e]] >= 0;
    my_hits += is_hit[e];
    my_evict += pos[e] >= 0 && !is_hit[e];
  }
  int total;
  const int packed = block_exclusive_sum(my_hits | (my_evict << 16), s_warp, &total);
  const int num_hits = total & 0xFFFF;
  const int num_evict = total >> 16;
  {
    int h = packed & 0xFFFF;
    int v = packed >> 16;
#pragma unroll
    for (int e = 0; e < D_ITEMS; ++e) {
      if (pos[e] < 0) continue;
      if (is_hit[e]) {
        s_hits[h++] = pos[e];
      } else {
        s_evict[v++] = pos[e];
      }
    }
  }

  // 3. Misses in top-k order (s_state complete: the prefix sum above has barriers). The m-th miss takes the
  //    m-th least recently used evictable position; s_evict is complete after the next prefix sum.
  bool miss[K_ITEMS];
  int my_miss = 0;
#pragma unroll
  for (int e = 0; e < K_ITEMS; ++e) {
    const int i = tid * K_ITEMS + e;
    miss[e] = i < K && s_state[i] == 0;
    my_miss += miss[e];
  }
  const int first = block_exclusive_sum(my_miss, s_warp, &total);
  const int num_miss = total;
  int dst_pos[K_ITEMS], dst_slot[K_ITEMS], src_row[K_ITEMS];
  {
    int m = first;
#pragma unroll
    for (int e = 0; e < K_ITEMS; ++e) {
      dst_pos[e] = miss[e] ? s_evict[m] : 0;
      m += miss[e];
    }
  }
#pragma unroll
  for (int e = 0; e < K_ITEMS; ++e) {
    dst_slot[e] = miss[e] ? __ldg(slots + dst_pos[e]) : 0;
    src_row[e] = miss[e] ? __ldg(hrows + tok[e]) : 0;
  }
  int32_t* __restrict__ psrc = a.plan_src + static_cast<int64_t>(b) * K;
  int32_t* __restrict__ pdst = a.plan_dst + static_cast<int64_t>(b) * K;
  {
    int m = first;
#pragma unroll
    for (int e = 0; e < K_ITEMS; ++e) {
      if (!miss[e]) continue;
      tokens[dst_pos[e]] = tok[e];
      o[tid * K_ITEMS + e] = dst_slot[e];
      psrc[m] = src_row[e];
      pdst[m] = dst_slot[e];
      ++m;
    }
  }

  // 4. New LRU order: [stale evictable, old order] + [just loaded, top-k order] + [hits, old order].
  const int stale = num_evict - num_miss;
  for (int k = tid; k < D; k += kPlanThreads) {
    int v;
    if (k < stale) {
      v = s_evict[num_miss + k];
    } else if (k < num_evict) {
      v = s_evict[k - stale];
    } else {
      v = s_hits[k - num_evict];
    }
    lru[k] = v;
  }
  if (tid == 0) {
    a.miss_count[b] = num_miss;
    if (a.counters != nullptr) {
      const unsigned long long h = static_cast<unsigned long long>(s_ring_hits) + num_hits;
      if (h) atomicAdd(&a.counters[0], h);
      if (num_miss) atomicAdd(&a.counters[1], static_cast<unsigned long long>(num_miss));
    }
  }
}

// One warp copies one row; each lane keeps all its 16 B chunks in flight before storing.
template <int kMaxChunksPerLane>
__device__ __forceinline__ void copy_row_vec16(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                               int chunks, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  int4 buf[kMaxChunksPerLane];
#pragma unroll
  for (int c = 0; c < kMaxChunksPerLane; ++c) {
    const int idx = lane + c * 32;
    if (idx < chunks) buf[c] = __ldg(s + idx);
  }
#pragma unroll
  for (int c = 0; c < kMaxChunksPerLane; ++c) {
    const int idx = lane + c * 32;
    if (idx < chunks) d[idx] = buf[c];
  }
}

__device__ __forceinline__ void copy_row_bytes(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                               int64_t row_bytes, int lane) {
  for (int64_t i = lane; i < row_bytes; i += 32) dst[i] = src[i];
}

__device__ __forceinline__ void copy_row(const uint8_t* src, uint8_t* dst, int64_t row_bytes, bool vec16,
                                         int lane) {
  if (vec16) {
    const int chunks = static_cast<int>(row_bytes / 16);
    if (chunks <= 64) {
      copy_row_vec16<2>(src, dst, chunks, lane);
    } else if (chunks <= 96) {
      copy_row_vec16<3>(src, dst, chunks, lane);
    } else {
      for (int base = 0; base < chunks; base += 96) {
        const int n = chunks - base < 96 ? chunks - base : 96;
        copy_row_vec16<3>(src + static_cast<int64_t>(base) * 16, dst + static_cast<int64_t>(base) * 16, n, lane);
      }
    }
  } else {
    copy_row_bytes(src, dst, row_bytes, lane);
  }
}

// kRows rows of one warp at once, for rows of at most 96 16-byte chunks: every lane issues all its loads of
// the kRows rows before its first store, so a warp keeps kRows rows in flight over PCIe instead of one.
template <int kRows, int kMaxChunksPerLane>
__device__ __forceinline__ void copy_rows_vec16(const uint8_t* const (&src)[kRows], uint8_t* const (&dst)[kRows],
                                                int chunks, int lane) {
  int4 buf[kRows][kMaxChunksPerLane];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int4* s = reinterpret_cast<const int4*>(src[r]);
#pragma unroll
    for (int c = 0; c < kMaxChunksPerLane; ++c) {
      const int idx = lane + c * 32;
      if (s != nullptr && idx < chunks) buf[r][c] = __ldg(s + idx);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    int4* d = reinterpret_cast<int4*>(dst[r]);
#pragma unroll
    for (int c = 0; c < kMaxChunksPerLane; ++c) {
      const int idx = lane + c * 32;
      if (d != nullptr && idx < chunks) d[idx] = buf[r][c];
    }
  }
}

// Grid-stride over all misses of the batch. Each block first turns the per-request miss counts into an
// inclusive prefix (s_prefix, B entries), then each warp finds its request by binary search. kRows > 1 (a capped
// grid on a side stream, see SwapInContext::set_max_copy_blocks): each warp takes kRows consecutive misses per
// iteration and keeps them all in flight, so a few SMs hold as many PCIe reads in flight as the full grid does.
template <int kRows>
__global__ void __launch_bounds__(kCopyThreads) swap_in_copy_kernel(
    const int32_t* __restrict__ miss_count, const int32_t* __restrict__ plan_src,
    const int32_t* __restrict__ plan_dst, const uint8_t* host_base, int64_t host_pitch, uint8_t* dev_base,
    int64_t dev_pitch, int64_t row_bytes, int batch, int K, bool vec16) {
  extern __shared__ int s_prefix[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  wait_for_prerequisite_grid();
  if (warp == 0) {  // warp 0 scans 32 requests at a time, carrying the running total in a register
    int carry = 0;
    for (int base = 0; base < batch; base += 32) {
      const int i = base + lane;
      int v = i < batch ? miss_count[i] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
      }
      v += carry;
      if (i < batch) s_prefix[i] = v;
      carry = __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
  const int total = s_prefix[batch - 1];
  const int warps_total = gridDim.x * (kCopyThreads / 32);
  const int chunks = static_cast<int>(row_bytes / 16);
  const bool batched = kRows > 1 && vec16 && chunks <= 96;
  for (int g0 = (blockIdx.x * (kCopyThreads / 32) + warp) * kRows; g0 < total; g0 += warps_total * kRows) {
    const uint8_t* src[kRows];
    uint8_t* dst[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int g = g0 + r;
      src[r] = nullptr;
      dst[r] = nullptr;
      if (g < total) {
        int lo = 0, hi = batch - 1;  // first request whose inclusive prefix exceeds g
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if (s_prefix[mid] > g) hi = mid; else lo = mid + 1;
        }
        const int m = g - (lo == 0 ? 0 : s_prefix[lo - 1]);
        const int64_t e = static_cast<int64_t>(lo) * K + m;
        src[r] = host_base + static_cast<int64_t>(plan_src[e]) * host_pitch;
        dst[r] = dev_base + static_cast<int64_t>(plan_dst[e]) * dev_pitch;
      }
    }
    if (batched) {
      if (chunks <= 64) {
        copy_rows_vec16<kRows, 2>(src, dst, chunks, lane);
      } else {
        copy_rows_vec16<kRows, 3>(src, dst, chunks, lane);
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (src[r] != nullptr) copy_row(src[r], dst[r], row_bytes, vec16, lane);
      }
    }
  }
}

// Rows a warp of the capped (side-stream) copy keeps in flight.
constexpr int kCappedCopyRows = 4;

// rows = n * L; row g: layer g / n, entry g % n.
__global__ void __launch_bounds__(kCopyThreads) backup_kernel(
    const uint8_t* dev_base, int64_t dev_layer_pitch, int64_t dev_pitch, uint8_t* host_base,
    int64_t host_layer_pitch, int64_t host_pitch, const int64_t* __restrict__ src_slots,
    const int64_t* __restrict__ dst_rows, int n, int layers, int64_t row_bytes, bool vec16) {
  const int lane = threadIdx.x & 31;
  const int warps_total = gridDim.x * (kCopyThreads / 32);
  const int64_t rows = static_cast<int64_t>(n) * layers;
  for (int64_t g = blockIdx.x * (kCopyThreads / 32) + (threadIdx.x >> 5); g < rows; g += warps_total) {
    const int64_t l = g / n;
    const int64_t i = g % n;
    const uint8_t* src = dev_base + l * dev_layer_pitch + src_slots[i] * dev_pitch;
    uint8_t* dst = host_base + l * host_layer_pitch + dst_rows[i] * host_pitch;
    copy_row(src, dst, row_bytes, vec16, lane);
  }
}

// Device-visible address of a tensor's data: itself for device memory, the UVA mapping for pinned host memory.
const uint8_t* device_visible(const torch::Tensor& t) {
  const void* p = t.data_ptr();
  if (t.is_cuda()) return static_cast<const uint8_t*>(p);
  cudaPointerAttributes attr{};
  HS_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  TORCH_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
              "host pool must be pinned (page-locked) host memory mapped into the device's address space");
  return static_cast<const uint8_t*>(attr.devicePointer);
}

bool vec16_ok(const void* a, const void* b, int64_t row_bytes, int64_t pitch_a, int64_t pitch_b) {
  return row_bytes % 16 == 0 && pitch_a % 16 == 0 && pitch_b % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

int sm_count() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    HS_CUDA_CHECK(cudaGetDevice(&dev));
    HS_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
  }
  return count;
}

void check_row_major(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

using PlanKernel = void (*)(PlanArgs);

// Items per thread: the smallest power of two with items * kPlanThreads >= n.
int items_for(int n) {
  int items = 1;
  while (items * kPlanThreads < n) items <<= 1;
  return items;
}

PlanKernel pick_plan_kernel(int d_items, int k_items) {
#define HS_PLAN_CASE(DI, KI) \
  if (d_items == DI && k_items == KI) return swap_in_plan_kernel<DI, KI>;
  HS_PLAN_CASE(1, 1)
  HS_PLAN_CASE(2, 1)
  HS_PLAN_CASE(2, 2)
  HS_PLAN_CASE(4, 1)
  HS_PLAN_CASE(4, 2)
  HS_PLAN_CASE(4, 4)
  HS_PLAN_CASE(8, 1)
  HS_PLAN_CASE(8, 2)
  HS_PLAN_CASE(8, 4)
  HS_PLAN_CASE(16, 1)
  HS_PLAN_CASE(16, 2)
  HS_PLAN_CASE(16, 4)
#undef HS_PLAN_CASE
  return nullptr;
}

int compute_major() {
  static int major = -1;
  if (major < 0) {
    int dev = 0;
    HS_CUDA_CHECK(cudaGetDevice(&dev));
    HS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  }
  return major;
}

int max_optin_smem() {
  static int max_smem = 0;
  if (max_smem == 0) {
    int dev = 0;
    HS_CUDA_CHECK(cudaGetDevice(&dev));
    HS_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  return max_smem;
}

// The plan kernel's launch parameters for one (D, K): validated, and the kernel's dynamic shared-memory limit
// raised, once per K by a SwapInContext.
struct PlanLaunch {
  int K = -1;
  PlanKernel kernel = nullptr;
  size_t smem = 0;
  uint32_t hash_mask = 0;
  uint32_t hash_shift = 0;
};

PlanLaunch plan_launch(int D, int K) {
  TORCH_CHECK(K <= D, "device buffer size D=", D, " must be >= top_k K=", K);
  TORCH_CHECK(D <= kPlanThreads * 16 && K <= kPlanThreads * 4, "the CUDA swap-in supports D <= ",
              kPlanThreads * 16, " and K <= ", kPlanThreads * 4, "; got D=", D, ", K=", K);
  // The hash of the selected tokens: 8 entries per key where shared memory allows (shorter probe sequences,
  // hash_insert), down to 2 (D 16384 with K 4096).
  const int max_smem = max_optin_smem();
  uint32_t hash_size = 0;
  size_t smem = 0;
  for (uint32_t per_key : {8u, 4u, 2u}) {
    hash_size = 128;  // >= 4 * 32: whole int4 stores initialize it
    while (hash_size < per_key * static_cast<uint32_t>(K)) hash_size <<= 1;
    smem = (2 * static_cast<size_t>(hash_size) + 2 * static_cast<size_t>(K) + D) * sizeof(int);
    if (smem + 512 <= static_cast<size_t>(max_smem)) break;
  }
  TORCH_CHECK(smem + 512 <= static_cast<size_t>(max_smem), "swap-in needs ", smem,
              " B of shared memory for D=", D, ", K=", K, "; the device allows ", max_smem);
  const PlanKernel kernel = pick_plan_kernel(items_for(D), items_for(K));
  TORCH_CHECK(kernel != nullptr, "no swap-in plan kernel for D=", D, ", K=", K);
  static std::vector<std::pair<PlanKernel, size_t>> configured;  // dynamic smem limit raised so far
  auto it = std::find_if(configured.begin(), configured.end(), [&](const auto& c) { return c.first == kernel; });
  if (it == configured.end() || it->second < smem) {
    HS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (it == configured.end()) {
      configured.emplace_back(kernel, smem);
    } else {
      it->second = smem;
    }
  }
  PlanLaunch p;
  p.K = K;
  p.kernel = kernel;
  p.smem = smem;
  p.hash_mask = hash_size - 1;
  p.hash_shift = 32 - static_cast<uint32_t>(__builtin_ctz(hash_size));
  return p;
}

// Every row of a 2-D int32 tensor starts at a 16-byte boundary (int4 loads of its runs are legal).
bool rows_aligned16(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.size(0) <= 1 || t.stride(0) % 4 == 0);
}

void check_int32_on(const torch::Tensor& t, const c10::Device& device, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt && t.device() == device, name, " must be int32 on ", device);
}

}  // namespace

// One layer's swap-in with everything but the batch bound once: the tables, the pools, the counters, the host
// pool's device-visible (UVA) address and the copy kernel's row layout. A call passes only the batch (top-k,
// seq_lens, request rows), so its host cost is two allocations (output, miss plan) and two launches
// (docs/kernels.md).
// The bound tensors are kept alive and must not be resized or re-pointed (set_) while the context exists: their
// addresses are read once, here.
class SwapInContext {
 public:
  SwapInContext(torch::Tensor buffer_slots, torch::Tensor buffer_tokens, torch::Tensor lru_order,
                torch::Tensor host_rows, torch::Tensor host_pool, torch::Tensor device_pool, int64_t num_recent,
                std::optional<torch::Tensor> counters)
      : buffer_slots_(std::move(buffer_slots)),
        buffer_tokens_(std::move(buffer_tokens)),
        lru_order_(std::move(lru_order)),
        host_rows_(std::move(host_rows)),
        host_pool_(std::move(host_pool)),
        device_pool_(std::move(device_pool)),
        counters_(std::move(counters)),
        device_(device_pool_.device()) {
    TORCH_CHECK(device_.is_cuda(), "device_pool must be a CUDA tensor");
    const c10::cuda::CUDAGuard guard(device_);
    check_row_major(buffer_slots_, "buffer_slots");
    check_row_major(buffer_tokens_, "buffer_tokens");
    check_row_major(lru_order_, "lru_order");
    check_row_major(host_rows_, "host_rows");
    check_row_major(host_pool_, "host_pool");
    check_row_major(device_pool_, "device_pool");
    check_int32_on(buffer_slots_, device_, "buffer_slots");
    check_int32_on(buffer_tokens_, device_, "buffer_tokens");
    check_int32_on(lru_order_, device_, "lru_order");
    check_int32_on(host_rows_, device_, "host_rows");
    TORCH_CHECK(lru_order_.sizes() == buffer_tokens_.sizes(), "buffer_tokens and lru_order must both be [max_reqs, D]");
    TORCH_CHECK(num_recent >= 1 && buffer_slots_.size(1) == buffer_tokens_.size(1) + num_recent,
                "buffer_slots must be [max_reqs, D + R] with R >= 1");
    TORCH_CHECK(host_pool_.scalar_type() == torch::kByte && device_pool_.scalar_type() == torch::kByte &&
                    host_pool_.size(1) == device_pool_.size(1),
                "host_pool and device_pool must be uint8 [N, row_bytes] with equal row_bytes");
    if (counters_.has_value()) {
      TORCH_CHECK(counters_->device() == device_ && counters_->scalar_type() == torch::kLong &&
                      counters_->numel() == 2 && counters_->is_contiguous(),
                  "counters must be a contiguous [2] int64 tensor on ", device_);
    }
    args_.buffer_slots = buffer_slots_.data_ptr<int32_t>();
    args_.buffer_tokens = buffer_tokens_.data_ptr<int32_t>();
    args_.lru_order = lru_order_.data_ptr<int32_t>();
    args_.host_rows = host_rows_.data_ptr<int32_t>();
    args_.counters =
        counters_.has_value() ? reinterpret_cast<unsigned long long*>(counters_->data_ptr<int64_t>()) : nullptr;
    args_.slots_stride = buffer_slots_.stride(0);
    args_.tokens_stride = buffer_tokens_.stride(0);
    args_.lru_stride = lru_order_.stride(0);
    args_.host_rows_stride = host_rows_.stride(0);
    args_.D = static_cast<int>(buffer_tokens_.size(1));
    args_.R = static_cast<int>(num_recent);
    args_.vec4_rows = args_.D % 4 == 0 && rows_aligned16(buffer_slots_) && rows_aligned16(buffer_tokens_) &&
                      rows_aligned16(lru_order_);
    host_base_ = device_visible(host_pool_);
    dev_base_ = device_pool_.data_ptr<uint8_t>();
    host_pitch_ = host_pool_.stride(0);
    dev_pitch_ = device_pool_.stride(0);
    row_bytes_ = device_pool_.size(1);
    vec16_ = vec16_ok(host_base_, dev_base_, row_bytes_, host_pitch_, dev_pitch_);
    pdl_ = compute_major() >= 9;
    static bool copy_configured = false;  // same shared-memory carveout as the plan kernel: no reconfiguration
    if (!copy_configured) {
      HS_CUDA_CHECK(cudaFuncSetAttribute(swap_in_copy_kernel<1>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
      HS_CUDA_CHECK(cudaFuncSetAttribute(swap_in_copy_kernel<kCappedCopyRows>,
                                         cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
      copy_configured = true;
    }
  }

  // Slots [B, K] int32 of the selected tokens; asynchronous on the current stream. top_k [B, K] int32 on the
  // pools' device; seq_lens and req_rows [B] (int64 on that device, else converted).
  torch::Tensor operator()(torch::Tensor top_k, torch::Tensor seq_lens, torch::Tensor req_rows) {
    const c10::cuda::CUDAGuard guard(device_);
    TORCH_CHECK(top_k.dim() == 2, "top_k must be [B, K]");
    check_int32_on(top_k, device_, "top_k");
    top_k = top_k.contiguous();
    const int64_t batch64 = top_k.size(0);
    seq_lens = as_batch_index(std::move(seq_lens), batch64, "seq_lens");
    req_rows = as_batch_index(std::move(req_rows), batch64, "req_rows");
    const int batch = static_cast<int>(batch64);
    const int K = static_cast<int>(top_k.size(1));
    torch::Tensor out(at::detail::empty_cuda({batch64, K}, torch::kInt, device_, std::nullopt));
    if (batch == 0) return out;
    if (plan_.K != K) plan_ = plan_launch(args_.D, K);
    // The miss plan (src host row, dst slot) and the per-request miss counts, straight from the caching allocator
    // (no tensor): only this call's kernels use it, in stream order, so it goes back to the cache on return.
    const at::DataPtr plan =
        c10::cuda::CUDACachingAllocator::get()->allocate((2 * batch64 * K + batch64) * sizeof(int32_t));
    PlanArgs a = args_;
    a.top_k = top_k.data_ptr<int32_t>();
    a.seq_lens = seq_lens.data_ptr<int64_t>();
    a.req_rows = req_rows.data_ptr<int64_t>();
    a.out = out.data_ptr<int32_t>();
    int32_t* base = static_cast<int32_t*>(plan.get());
    a.plan_src = base;
    a.plan_dst = base + batch64 * K;
    a.miss_count = base + 2 * batch64 * K;
    a.K = K;
    a.hash_mask = plan_.hash_mask;
    a.hash_shift = plan_.hash_shift;
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index());
    plan_.kernel<<<batch, kPlanThreads, plan_.smem, stream>>>(a);
    HS_CUDA_CHECK(cudaGetLastError());

    const int max_rows = batch * K;
    int blocks = std::max(1, std::min(2 * sm_count(), (max_rows + 7) / 8));
    if (max_copy_blocks_ > 0) blocks = std::min(blocks, max_copy_blocks_);  // a side stream's share (see setter)
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kCopyThreads);
    cfg.dynamicSmemBytes = batch * sizeof(int);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_ ? 1 : 0;
    const bool capped = max_copy_blocks_ > 0;
    HS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, capped ? swap_in_copy_kernel<kCappedCopyRows> : swap_in_copy_kernel<1>,
                                     static_cast<const int32_t*>(a.miss_count),
                                     static_cast<const int32_t*>(a.plan_src), static_cast<const int32_t*>(a.plan_dst),
                                     host_base_, host_pitch_, dev_base_, dev_pitch_, row_bytes_, batch, K, vec16_));
    return out;
  }

 private:
  torch::Tensor as_batch_index(torch::Tensor t, int64_t batch, const char* name) const {
    if (t.device() != device_ || t.scalar_type() != torch::kLong) t = t.to(device_, torch::kLong);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, name, " must be [", batch, "]");
    return t.contiguous();
  }

  torch::Tensor buffer_slots_, buffer_tokens_, lru_order_, host_rows_, host_pool_, device_pool_;
  std::optional<torch::Tensor> counters_;
  c10::Device device_;
  PlanArgs args_{};  // the bound part of the plan kernel's arguments
  PlanLaunch plan_;  // for the last K seen
  const uint8_t* host_base_ = nullptr;
  uint8_t* dev_base_ = nullptr;
  int64_t host_pitch_ = 0, dev_pitch_ = 0, row_bytes_ = 0;
  bool vec16_ = false, pdl_ = false;
  int max_copy_blocks_ = 0;  // 0: the default grid (two blocks an SM, fewer for few rows)

 public:
  // Caps the copy kernel's grid. For a swap-in launched on a side stream beside other kernels: the copy's warps
  // wait on PCIe reads, so a few dozen blocks keep the link busy (bench_swap_in.py --copy-blocks) while the full
  // grid, resident from the plan kernel's start (programmatic launch), would take every SM from the neighbours.
  void set_max_copy_blocks(int64_t blocks) {
    TORCH_CHECK(blocks >= 0 && blocks <= (1 << 20), "max_copy_blocks must be in [0, 2^20], got ", blocks);
    max_copy_blocks_ = static_cast<int>(blocks);
  }
  int64_t max_copy_blocks() const { return max_copy_blocks_; }
};

// The unbound entry point (tests, references, one-off calls): binds a context for this call only.
torch::Tensor swap_in(torch::Tensor top_k, torch::Tensor seq_lens, torch::Tensor req_rows,
                      torch::Tensor buffer_slots, torch::Tensor buffer_tokens, torch::Tensor lru_order,
                      torch::Tensor host_rows, torch::Tensor host_pool, torch::Tensor device_pool, int64_t num_recent,
                      std::optional<torch::Tensor> counters, int64_t max_copy_blocks) {
  SwapInContext context(std::move(buffer_slots), std::move(buffer_tokens), std::move(lru_order),
                        std::move(host_rows), std::move(host_pool), std::move(device_pool), num_recent,
                        std::move(counters));
  context.set_max_copy_blocks(max_copy_blocks);
  return context(std::move(top_k), std::move(seq_lens), std::move(req_rows));
}

void backup(torch::Tensor device_pool, torch::Tensor host_pool, torch::Tensor src_slots, torch::Tensor dst_rows) {
  const c10::cuda::CUDAGuard guard(device_pool.device());
  TORCH_CHECK(device_pool.dim() == 3 && host_pool.dim() == 3, "pools must be [L, N, row_bytes]");
  TORCH_CHECK(device_pool.stride(2) == 1 && host_pool.stride(2) == 1, "pool rows must be contiguous");
  TORCH_CHECK(src_slots.is_contiguous() && dst_rows.is_contiguous(), "index tensors must be contiguous");
  const int n = static_cast<int>(src_slots.size(0));
  const int layers = static_cast<int>(device_pool.size(0));
  if (n == 0 || layers == 0) return;
  const uint8_t* dev_base = device_pool.data_ptr<uint8_t>();
  uint8_t* host_base = const_cast<uint8_t*>(device_visible(host_pool));
  const int64_t row_bytes = device_pool.size(2);
  const bool vec16 = vec16_ok(host_base, dev_base, row_bytes, host_pool.stride(1), device_pool.stride(1)) &&
                     host_pool.stride(0) % 16 == 0 && device_pool.stride(0) % 16 == 0;
  const int64_t rows = static_cast<int64_t>(n) * layers;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(4 * sm_count(), (rows + 7) / 8)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  backup_kernel<<<blocks, kCopyThreads, 0, stream>>>(
      dev_base, device_pool.stride(0), device_pool.stride(1), host_base, host_pool.stride(0), host_pool.stride(1),
      src_slots.data_ptr<int64_t>(), dst_rows.data_ptr<int64_t>(), n, layers, row_bytes, vec16);
  HS_CUDA_CHECK(cudaGetLastError());
}

// dst_pool[l, dst_rows[i]] = src_pool[l, src_rows[i]] for every layer l; each pool is a CUDA tensor or pinned
// host memory (read or written through its UVA address). The backup kernel's loop is direction-agnostic.
void copy_rows(torch::Tensor src_pool, torch::Tensor dst_pool, torch::Tensor src_rows, torch::Tensor dst_rows) {
  TORCH_CHECK(src_pool.is_cuda() || dst_pool.is_cuda(), "copy_rows: one pool must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(src_pool.is_cuda() ? src_pool.device() : dst_pool.device());
  TORCH_CHECK(src_pool.dim() == 3 && dst_pool.dim() == 3, "pools must be [L, N, row_bytes]");
  TORCH_CHECK(src_pool.size(0) == dst_pool.size(0) && src_pool.size(2) == dst_pool.size(2),
              "pools must have the same layers and row bytes");
  TORCH_CHECK(src_pool.scalar_type() == torch::kByte && dst_pool.scalar_type() == torch::kByte,
              "pools must be uint8");
  TORCH_CHECK(src_pool.stride(2) == 1 && dst_pool.stride(2) == 1, "pool rows must be contiguous");
  TORCH_CHECK(src_rows.is_cuda() && dst_rows.is_cuda() && src_rows.scalar_type() == torch::kLong &&
                  dst_rows.scalar_type() == torch::kLong && src_rows.is_contiguous() && dst_rows.is_contiguous() &&
                  src_rows.dim() == 1 && src_rows.sizes() == dst_rows.sizes(),
              "src_rows and dst_rows must be equal-length contiguous 1-D int64 CUDA tensors");
  const int n = static_cast<int>(src_rows.size(0));
  const int layers = static_cast<int>(src_pool.size(0));
  if (n == 0 || layers == 0) return;
  const uint8_t* src_base = device_visible(src_pool);
  uint8_t* dst_base = const_cast<uint8_t*>(device_visible(dst_pool));
  const int64_t row_bytes = src_pool.size(2);
  const bool vec16 = vec16_ok(src_base, dst_base, row_bytes, src_pool.stride(1), dst_pool.stride(1)) &&
                     src_pool.stride(0) % 16 == 0 && dst_pool.stride(0) % 16 == 0;
  const int64_t rows = static_cast<int64_t>(n) * layers;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(4 * sm_count(), (rows + 7) / 8)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  backup_kernel<<<blocks, kCopyThreads, 0, stream>>>(
      src_base, src_pool.stride(0), src_pool.stride(1), dst_base, dst_pool.stride(0), dst_pool.stride(1),
      src_rows.data_ptr<int64_t>(), dst_rows.data_ptr<int64_t>(), n, layers, row_bytes, vec16);
  HS_CUDA_CHECK(cudaGetLastError());
}

// kernels/csrc/topk_kernels.cu
torch::Tensor topk_rows(torch::Tensor scores, torch::Tensor lens, int64_t k);
int64_t topk_rows_max_width(int64_t device);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swap_in", &swap_in, "HiSparse swap-in: plan kernel + copy kernel (one layer, one batch)");
  pybind11::class_<SwapInContext>(m, "SwapInContext",
                                  "One layer's swap-in with its tables, pools and counters bound once")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          int64_t, std::optional<torch::Tensor>>(),
           pybind11::arg("buffer_slots"), pybind11::arg("buffer_tokens"), pybind11::arg("lru_order"),
           pybind11::arg("host_rows"), pybind11::arg("host_pool"), pybind11::arg("device_pool"),
           pybind11::arg("num_recent"), pybind11::arg("counters"))
      .def("__call__", &SwapInContext::operator(), "slots [B, K] for (top_k, seq_lens, req_rows)",
           pybind11::arg("top_k"), pybind11::arg("seq_lens"), pybind11::arg("req_rows"))
      .def_property("max_copy_blocks", &SwapInContext::max_copy_blocks, &SwapInContext::set_max_copy_blocks,
                    "cap on the copy kernel's blocks (0: the default grid)");
  m.def("backup", &backup, "Copy rows of all layers device -> pinned host in one launch");
  m.def("copy_rows", &copy_rows, "Copy rows of all layers between device / pinned host pools in one launch");
  m.def("topk_rows", &topk_rows, "Top-k positions of each row's visible scores (radix select, ascending order)",
        pybind11::arg("scores"), pybind11::arg("lens"), pybind11::arg("k"));
  m.def("topk_rows_max_width", &topk_rows_max_width, "Widest row the top-k kernel takes on a device",
        pybind11::arg("device"));
}
