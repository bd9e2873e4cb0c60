// kv_accept: move each request's accepted tree rows from prefix_len + accept_nodes[i] to prefix_len + i in
// every layer's cache, then prefix_lens += accept_len + 1: all layers in one launch.
//
// Work split: one thread-block cluster of C blocks per request (C up to 8, chosen so the grid fills the
// chip; C = 1 without a cluster on devices below sm_90 or when the binary has no sm_90 code). Each block
// first compacts the request's *moving* rows (accept_nodes[i] != i) into a list in shared memory (at most
// max_rows = min(width, kMaxRows) entries): rows that stay in place cost neither a read nor a write. The
// cluster then divides the flat column space (layer, 16-byte unit within a row) of all layers between its
// blocks; a block moves its columns in rounds of kThreads * kUnits units: every thread loads its units of
// all moving rows of the round's columns into registers, the block barrier, then every thread stores. All rows of one
// column belong to one round of one block, and only rows of the same column can overlap (accepted
// [0, 2, 3] moves 2 -> 1 and 3 -> 2), so every read of a position precedes every write to it.
//
// Rows of whole 16-byte units on sm_90 (MLA latent rows, K / V rows) take the bulk-copy path instead: a
// block stages its columns' moving rows in shared memory with cp.async.bulk (TMA) loads that complete on
// one mbarrier, then writes them back with bulk stores. No registers hold data and no per-unit index
// arithmetic is done: one thread issues one copy of up to a whole row, so a B 64 batch of 61 MLA layers
// is ~32 copies in and ~32 out per block. Columns are (layer, chunk of W bytes of the row), W chosen on
// the host so that every moving row of one column fits the staging buffer; the read-before-write rule
// is the same as above (a round's loads all land before any of its stores is issued).
//
// prefix_lens: every block reads prefix_lens[b] first, then arrives on the cluster barrier; block 0
// waits on that barrier before it writes prefix_lens[b] = P + a + 1, so no block can read the advanced
// value. (Blocks of other requests never read it.) With C = 1 the block barrier after the first reads
// orders them before block 0's write: no cluster barrier is needed (nor compiled below sm_90).
//
// accept_nodes is [B, width] of any width (verify's [B, N], SGLang's [B, steps + 1]); only entries
// 0..a are read. With cap = min(max_pages * page_size, 2**31 - 1) positions of the page table, request b
// (a = accept_len[b], P = prefix_lens[b]) is checked in this order, and skipped whole at the first
// violation, which is reported to the error word (eagle3/errors.h; reference.kv_accept raises the same
// message): a in [0, max_rows - 1] with max_rows = min(width, kMaxRows); P in [0, cap - 1 - a] (every
// destination P + i lies in the table); each accepted node in [0, cap - 1 - P] (its source likewise);
// then the page id of every source and destination position's page slot in [0, num_pages - 1] (rows that
// stay in place included). A skipped request's cache rows and prefix_len stay untouched (every block of
// the request sees the same values, so all skip together); nothing is ever read or written out of bounds.
// Requests are assumed to own disjoint pages (as every engine's page allocator gives them).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "eagle3/checks.h"
#include "eagle3/device.h"
#include "eagle3/errors.cuh"
#include "eagle3/launch.h"
#include "eagle3/pdl.cuh"

namespace eagle3 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnits = 8;                       // units (up to 16 bytes each) per thread per round
constexpr int kRoundUnits = kThreads * kUnits;  // 2048: a round holds every moving row of >= 1 column
constexpr int kMaxRows = kRoundUnits;           // accepted rows per request: one column's rows in one round
constexpr int kMaxLayers = 128;                 // per launch (kernel parameter space); more layers: more launches
constexpr int kMaxCluster = 8;
constexpr int kMinBlocksPerSm = 3;             // <= 85 registers: no spills in the 16-byte instance (64 spilled 40 B)

struct LayerBases {
  void* base[kMaxLayers];
};

// sm_90+: below it the launcher uses C = 1, which needs no cluster barrier (see prefix_lens above).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait;" ::: "memory");
#endif
}

// accept_len, then prefix_len (its bound depends on a): true (and reported) when request b is to be skipped.
__device__ __forceinline__ bool request_is_bad(int64_t* err, int64_t b, int a, int64_t P, int max_rows, int64_t cap) {
  if (a < 0 || a >= max_rows) {
    if (threadIdx.x == 0) report_range(err, kOpKvAccept, kArgAcceptLen, a, 0, max_rows - 1, b);
    return true;
  }
  if (P < 0 || P > cap - 1 - a) {
    if (threadIdx.x == 0) report_range(err, kOpKvAccept, kArgPrefixLens, P, 0, cap - 1 - a, b);
    return true;
  }
  return false;
}

// q = n / d for n < 2**24 and d >= 1, from a float reciprocal plus one correction step (an integer division
// costs ~20 instructions per unit; this costs 5).
__device__ __forceinline__ uint32_t div_small(uint32_t n, uint32_t d, float inv_d) {
  uint32_t q = static_cast<uint32_t>(static_cast<float>(n) * inv_d);
  if (q * d > n) {
    --q;
  } else if ((q + 1) * d <= n) {
    ++q;
  }
  return q;
}

// Unit u of the round whose columns start at cs: row u / G of the moving rows, column cs + u % G, that
// column's layer and unit within the row. False when the unit falls outside (row >= m or column >= c1).
__device__ __forceinline__ bool locate(uint32_t u, uint32_t cs, uint32_t c1, uint32_t G, float inv_g, int m,
                                       uint32_t vpr, float inv_vpr, uint32_t& row, uint32_t& layer, uint32_t& unit) {
  row = div_small(u, G, inv_g);
  const uint32_t col = cs + (u - row * G);
  if (row >= static_cast<uint32_t>(m) || col >= c1) return false;
  layer = div_small(col, vpr, inv_vpr);
  unit = col - layer * vpr;
  return true;
}

// Request b's moving rows (accept_nodes[i] != i for i <= a), as flat row indices (page * page_size +
// slot) into src_row / dst_row, their count in *s_m; *s_bad set (and reported) for a node outside
// [0, cap - 1 - P] or a page id outside [0, num_pages) (the caller checked a and P). node0 is
// accept_nodes[b, threadIdx.x], loaded by the caller together with prefix_lens[b] and accept_len[b]
// (one round trip instead of two).
template <int kBlockThreads>
__device__ __forceinline__ void collect_moving_rows(int64_t* err, int64_t b, const int32_t* __restrict__ pages,
                                                    const int32_t* __restrict__ nodes, int node0, int a,
                                                    int64_t P, int64_t cap, int64_t page_size, int64_t num_pages,
                                                    int64_t* src_row, int64_t* dst_row, int* s_m, int* s_bad) {
  for (int i = threadIdx.x; i <= a; i += kBlockThreads) {
    const int node = i < kBlockThreads ? node0 : nodes[i];
    if (node < 0 || node > cap - 1 - P) {
      report_range(err, kOpKvAccept, kArgAcceptNodes, node, 0, cap - 1 - P, b, i);
      *s_bad = 1;
      continue;
    }
    const int64_t src = P + node, dst = P + i;  // < cap (P + a < cap: checked by the caller)
    const int64_t src_slot = src / page_size, dst_slot = dst / page_size;
    const int64_t sp = pages[src_slot], dp = pages[dst_slot];
    if (sp < 0 || sp >= num_pages || dp < 0 || dp >= num_pages) {
      const bool src_bad = sp < 0 || sp >= num_pages;
      report_range(err, kOpKvAccept, kArgPageTable, src_bad ? sp : dp, 0, num_pages - 1, b,
                   src_bad ? src_slot : dst_slot);
      *s_bad = 1;
      continue;
    }
    if (node != i) {  // a row that stays in place is neither read nor written
      const int k = atomicAdd(s_m, 1);
      src_row[k] = sp * page_size + src % page_size;
      dst_row[k] = dp * page_size + dst % page_size;
    }
  }
}

// layers        num_layers bases, each a contiguous cache [num_pages, page_size, row] of `vpr` units per row
// page_table    [B, max_pages] int32, row stride pt_stride
// prefix_lens   [B] int32 (advanced when `advance`)
// accept_nodes  [B, width] int32
// accept_len    [B] int32
// err           the device error word
// grid: B * C blocks in clusters of C (none when C = 1 below sm_90); block rank r of cluster b serves
// request b, columns [r, r+1) / C of the num_layers * vpr (< 2**24) columns. cap: positions in a page
// table (see the top). dynamic shared memory: 2 * max_rows int64 (rows to read and write).
template <typename unit_t>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) kv_accept_kernel(
    const __grid_constant__ LayerBases layers, int num_layers, uint32_t vpr, float inv_vpr, int C,
    const int32_t* __restrict__ page_table, int64_t pt_stride, int64_t cap, int32_t* prefix_lens,
    const int32_t* __restrict__ accept_nodes, const int32_t* __restrict__ accept_len, int64_t width,
    int max_rows, int64_t page_size, int64_t num_pages, bool advance, int64_t* err) {
  extern __shared__ int64_t rows_smem[];
  int64_t* src_row = rows_smem;             // [m] flat row index (page * page_size + slot) to read
  int64_t* dst_row = rows_smem + max_rows;  // [m] flat row index to write
  __shared__ int s_m, s_bad;
  const int64_t b = blockIdx.x / C;
  const int rank = blockIdx.x % C;

  // Three independent loads (one round trip), then the page table (a second one).
  const int64_t P = prefix_lens[b];
  const int a = accept_len[b];
  const int node0 = threadIdx.x < width ? accept_nodes[b * width + threadIdx.x] : 0;
  const bool bad0 = request_is_bad(err, b, a, P, max_rows, cap);
  if (threadIdx.x == 0) {
    s_m = 0;
    s_bad = bad0;
  }
  __syncthreads();   // also: every thread of this block has read prefix_lens[b]
  cluster_arrive();  // release: this block is done reading prefix_lens[b]
  allow_next_grid();  // a next kernel launched with PDL may launch now (it waits for this grid before reading)

  if (!bad0) {
    collect_moving_rows<kThreads>(err, b, page_table + b * pt_stride, accept_nodes + b * width, node0, a, P, cap,
                                  page_size, num_pages, src_row, dst_row, &s_m, &s_bad);
  }
  __syncthreads();
  const int m = s_m;
  const bool bad = s_bad;
  if (!bad && m > 0) {
    const uint32_t total = static_cast<uint32_t>(num_layers) * vpr;
    const uint32_t c0 = static_cast<uint32_t>(static_cast<uint64_t>(total) * rank / C);
    const uint32_t c1 = static_cast<uint32_t>(static_cast<uint64_t>(total) * (rank + 1) / C);
    // Rounds of G columns x m rows (G * m <= kRoundUnits, as few rounds as possible, balanced): unit u of
    // a round is row u / G, column u % G, so a warp reads and writes consecutive units of one row.
    const uint32_t most = kRoundUnits / m;
    const uint32_t rounds = (c1 - c0 + most - 1) / most;
    const uint32_t G = rounds > 0 ? (c1 - c0 + rounds - 1) / rounds : 1;
    const float inv_g = 1.0f / static_cast<float>(G);
    for (uint32_t cs = c0; cs < c1; cs += G) {
      unit_t r[kUnits];
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        uint32_t row, layer, unit;
        if (locate(threadIdx.x + k * kThreads, cs, c1, G, inv_g, m, vpr, inv_vpr, row, layer, unit)) {
          r[k] = static_cast<const unit_t*>(layers.base[layer])[src_row[row] * vpr + unit];
        }
      }
      __syncthreads();  // every read of this round's columns happens before any write to them
      // The destinations are recomputed rather than kept from the loads: 8 fewer 64-bit registers, so
      // that the kernel stays within 85 registers without spilling.
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        uint32_t row, layer, unit;
        if (locate(threadIdx.x + k * kThreads, cs, c1, G, inv_g, m, vpr, inv_vpr, row, layer, unit)) {
          static_cast<unit_t*>(layers.base[layer])[dst_row[row] * vpr + unit] = r[k];
        }
      }
    }
  }

  cluster_wait();  // acquire: every block of this request has read prefix_lens[b]
  if (advance && rank == 0 && threadIdx.x == 0 && !bad) prefix_lens[b] = static_cast<int32_t>(P + a + 1);
}

// ---- bulk-copy (TMA) path, sm_90+ ------------------------------------------------------------------------

constexpr int kBulkThreads = 128;
constexpr int64_t kMaxStageBytes = 96 * 1024;  // staging per block, at most
// Measured on the H200 (bench/results/kv_accept_h200.log, L 61 B 64 N 8, 4 rows moving): staging sized so
// that every cluster of the grid is resident at once (36 KB at B 64, 6 blocks an SM), split in two slots so
// that a block's second half of columns loads while the first half stores: 14.92 us against 15.50 with one
// slot (bench/results/kv_accept_sweep_h200.log). 48 KB left 2 of the 64 clusters for a second wave (ncu: 62
// active clusters), and 4 slots at 48 KB cost more in barriers than they overlapped (20.4 vs 18.6 us).
// The sweep again at 799b9e5 (kv_accept_sweep_h200.log, its second run) kept these: at B 64, 36 KB in 1 / 3 / 4
// slots took 15.11 / 15.34 / 14.87 us against the grid-sized default's 14.72, 42 KB 14.67 (but 6.70 vs 6.42 at
// B 1), clusters of at most 4 blocks 16.64.
constexpr int64_t kBulkStages = 2;
// Kernels are launched without programmatic dependent launch: with it the next call's blocks waited on SMs
// whose staging the running grid needed (16.33 vs 15.50 us at B 64; it helped B 1 only, 5.86 vs 6.39;
// kv_accept_sweep_h200.log), so the option was removed.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Each block: the request's moving rows (as above), then rounds of columns; every column is (layer, chunk
// of W bytes) and a round holds its columns' chunks of every moving row, staged at item * W in one of
// `stages` slots of slot_bytes. Rounds are pipelined: the first `stages` rounds' loads are issued at once;
// round r's stores go out as soon as its loads land (mbarrier of its slot), and the slot of round r - 1
// is refilled with round r - 1 + stages once round r - 1's stores have read it. Rounds hold disjoint
// columns, so only a round's own loads must precede its stores.
// dynamic shared memory: [stages x slot_bytes][max_rows int64 src rows][max_rows int64 dst rows][stages
// mbarriers]. The other parameters as the register kernel's.
__global__ void __launch_bounds__(kBulkThreads) kv_accept_bulk_kernel(
    const __grid_constant__ LayerBases layers, int num_layers, uint32_t row_bytes, uint32_t W, uint32_t q, int C,
    const int32_t* __restrict__ page_table, int64_t pt_stride, int64_t cap, int32_t* prefix_lens,
    const int32_t* __restrict__ accept_nodes, const int32_t* __restrict__ accept_len, int64_t width,
    int max_rows, int64_t page_size, int64_t num_pages, bool advance, int64_t* err, uint32_t slot_bytes,
    uint32_t stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char bulk_smem[];
  unsigned char* stage = bulk_smem;
  int64_t* src_row = reinterpret_cast<int64_t*>(bulk_smem + static_cast<size_t>(stages) * slot_bytes);
  int64_t* dst_row = src_row + max_rows;
  uint64_t* bar = reinterpret_cast<uint64_t*>(dst_row + max_rows);
  __shared__ int s_m, s_bad;
  const int64_t b = blockIdx.x / C;
  const int rank = blockIdx.x % C;

  const int64_t P = prefix_lens[b];
  const int a = accept_len[b];
  const int node0 = threadIdx.x < width ? accept_nodes[b * width + threadIdx.x] : 0;
  const bool bad0 = request_is_bad(err, b, a, P, max_rows, cap);
  if (threadIdx.x == 0) {
    s_m = 0;
    s_bad = bad0;
    for (uint32_t k = 0; k < stages; ++k) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar + k)), "r"(kBulkThreads) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy
  }
  __syncthreads();   // also: every thread of this block has read prefix_lens[b]
  cluster_arrive();  // release: this block is done reading prefix_lens[b]
  allow_next_grid();  // a next kernel launched with PDL may launch now (it waits for this grid before reading)

  if (!bad0) {
    collect_moving_rows<kBulkThreads>(err, b, page_table + b * pt_stride, accept_nodes + b * width, node0, a, P,
                                      cap, page_size, num_pages, src_row, dst_row, &s_m, &s_bad);
  }
  __syncthreads();
  const uint32_t m = static_cast<uint32_t>(s_m);
  if (!s_bad && m > 0) {
    const uint32_t total = static_cast<uint32_t>(num_layers) * q;
    const uint32_t c0 = static_cast<uint32_t>(static_cast<uint64_t>(total) * rank / C);
    const uint32_t c1 = static_cast<uint32_t>(static_cast<uint64_t>(total) * (rank + 1) / C);
    const uint32_t per_round = slot_bytes / (m * W);  // >= 1: max_rows * W <= slot_bytes
    const uint32_t rounds = (c1 - c0 + per_round - 1) / per_round;
    // Item j of round r: column c0 + r * per_round + j / m, moving row j % m, at j * W in slot r % stages.
    auto items_of = [&](uint32_t r) { return (min(c1, c0 + (r + 1) * per_round) - (c0 + r * per_round)) * m; };
    auto load_round = [&](uint32_t r) {
      const uint32_t cs = c0 + r * per_round, items = items_of(r);
      const uint32_t bar_addr = smem_addr(bar + r % stages);
      unsigned char* slot = stage + static_cast<size_t>(r % stages) * slot_bytes;
      uint32_t mine = 0;
      for (uint32_t j = threadIdx.x; j < items; j += kBulkThreads) mine += min(W, row_bytes - ((cs + j / m) % q) * W);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(mine) : "memory");
      for (uint32_t j = threadIdx.x; j < items; j += kBulkThreads) {
        const uint32_t col = cs + j / m, layer = col / q, off = (col % q) * W;
        const unsigned char* src =
            static_cast<const unsigned char*>(layers.base[layer]) + src_row[j % m] * row_bytes + off;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_addr(slot + static_cast<size_t>(j) * W)),
            "l"(src), "r"(min(W, row_bytes - off)), "r"(bar_addr)
            : "memory");
      }
    };
    for (uint32_t r = 0; r < min(stages, rounds); ++r) load_round(r);
    for (uint32_t r = 0; r < rounds; ++r) {
      // Every load of round r has landed (all threads arrived, all bytes counted) before its stores.
      asm volatile(
          "{\n.reg .pred done;\nLAB_WAIT:\n"
          "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
          "@!done bra LAB_WAIT;\n}" ::"r"(smem_addr(bar + r % stages)),
          "r"((r / stages) & 1)
          : "memory");
      const uint32_t cs = c0 + r * per_round, items = items_of(r);
      const unsigned char* slot = stage + static_cast<size_t>(r % stages) * slot_bytes;
      for (uint32_t j = threadIdx.x; j < items; j += kBulkThreads) {
        const uint32_t col = cs + j / m, layer = col / q, off = (col % q) * W;
        unsigned char* dst = static_cast<unsigned char*>(layers.base[layer]) + dst_row[j % m] * row_bytes + off;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                     "r"(smem_addr(slot + static_cast<size_t>(j) * W)), "r"(min(W, row_bytes - off))
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");  // one group per thread per round
      if (stages > 1) {
        if (r >= 1 && r - 1 + stages < rounds) {
          asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // round r - 1's stores have read it
          __syncthreads();                                                 // ... in every thread
          load_round(r - 1 + stages);
        }
      } else if (r + 1 < rounds) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // one slot: round r frees it
        __syncthreads();
        load_round(r + 1);
      }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }

  cluster_wait();  // acquire: every block of this request has read prefix_lens[b]
  if (advance && rank == 0 && threadIdx.x == 0 && !s_bad) prefix_lens[b] = static_cast<int32_t>(P + a + 1);
#endif
}

// The code the runtime picked for this file's kernels on the current device, as 10 * major + minor (one
// fatbinary: one kernel's answer holds for all). Cluster launches and the bulk path need sm_90 code,
// not only an sm_90 device: a build for 8.0 alone has no cluster barrier and an empty bulk kernel.
int binary_version(int device) {
  static std::atomic<int> cached[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && cached[device].load(std::memory_order_relaxed) > 0) {
    return cached[device].load(std::memory_order_relaxed);
  }
  cudaFuncAttributes attrs{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kv_accept_bulk_kernel));
  if (cacheable) cached[device].store(attrs.binaryVersion, std::memory_order_relaxed);
  return attrs.binaryVersion;
}

bool hopper(int device) { return sm_major(device) >= 9 && binary_version(device) >= 90; }

struct Group {
  int width;      // bytes per unit: 16, 8, 4, 2 or 1
  int64_t vpr;    // units per row
  std::vector<void*> bases;
};

// What every launch of one call shares: the requests' tensors and the bounds their values are checked by.
struct Requests {
  int64_t B;
  const int32_t* page_table;
  int64_t pt_stride;
  int64_t cap;  // positions a page table holds: min(max_pages * page_size, 2**31 - 1)
  int32_t* prefix_lens;
  const int32_t* accept_nodes;
  const int32_t* accept_len;
  int64_t width;  // accept_nodes' columns
  int max_rows;   // min(width, kMaxRows): accept_len <= max_rows - 1, shared memory sized by it
  int64_t page_size;
  int64_t num_pages;
  int64_t* err;
};

LayerBases layer_bases(const Group& g, size_t first, size_t count) {
  LayerBases bases{};
  for (size_t i = 0; i < count; ++i) bases.base[i] = g.bases[first + i];
  return bases;
}

// cluster: the cluster size of the launch, 0 for none (then C = 1).
template <typename unit_t>
void launch(const Group& g, size_t first, size_t count, int C, int cluster, const Requests& r, bool advance,
            cudaStream_t stream) {
  launch_ex(kv_accept_kernel<unit_t>, dim3(static_cast<unsigned>(r.B * C)), dim3(kThreads),
            2 * static_cast<size_t>(r.max_rows) * sizeof(int64_t), stream, cluster, false, layer_bases(g, first, count),
            static_cast<int>(count), static_cast<uint32_t>(g.vpr), 1.0f / static_cast<float>(g.vpr), C, r.page_table,
            r.pt_stride, r.cap, r.prefix_lens, r.accept_nodes, r.accept_len, r.width, r.max_rows, r.page_size,
            r.num_pages, advance, r.err);
}

// The bulk path for a group of 16-byte rows: W (bytes per column chunk) so that a column's max_rows rows
// fit the staging buffer, the buffer sized to a block's share of the columns and to the blocks an SM must
// hold.
void launch_bulk(const Group& g, size_t first, size_t count, int C, const Requests& r, int device, bool advance,
                 cudaStream_t stream) {
  const int64_t row_bytes = g.vpr * 16;
  const int64_t rows = r.max_rows;
  // Up to kBulkStages slots, each holding one column's chunks of all max_rows rows (the most that can move), in a
  // budget sized by the grid's blocks per SM, with room for cluster placement (x 1.5).
  const int64_t sms = num_sms(device);
  const int64_t per_sm = std::max<int64_t>(1, (3 * r.B * C + 2 * sms - 1) / (2 * sms));
  const int64_t budget = std::max<int64_t>(
      16 * rows, std::min<int64_t>(kMaxStageBytes, (smem_per_sm(device) / per_sm - 2048) / 1024 * 1024));
  const int64_t stages = std::max<int64_t>(1, std::min<int64_t>(kBulkStages, budget / (16 * rows)));
  const int64_t W = std::min<int64_t>(row_bytes, budget / stages / (16 * rows) * 16);  // >= 16
  const int64_t q = (row_bytes + W - 1) / W;
  const int64_t cols = (static_cast<int64_t>(count) * q + C - 1) / C;  // a block's columns, at most
  const int64_t per_slot = std::max<int64_t>(1, (cols + stages - 1) / stages);
  const int64_t slot = std::min<int64_t>(budget / stages / 16 * 16, per_slot * rows * W);
  const size_t smem = static_cast<size_t>(stages * slot + 2 * rows * sizeof(int64_t) + stages * sizeof(uint64_t));
  if (smem > 48 * 1024) {  // a host-side attribute of the current device: no sync, graph-capture safe
    C10_CUDA_CHECK(cudaFuncSetAttribute(kv_accept_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  launch_ex(kv_accept_bulk_kernel, dim3(static_cast<unsigned>(r.B * C)), dim3(kBulkThreads), smem, stream, C, false,
            layer_bases(g, first, count), static_cast<int>(count), static_cast<uint32_t>(row_bytes),
            static_cast<uint32_t>(W), static_cast<uint32_t>(q), C, r.page_table, r.pt_stride, r.cap, r.prefix_lens,
            r.accept_nodes, r.accept_len, r.width, r.max_rows, r.page_size, r.num_pages, advance, r.err,
            static_cast<uint32_t>(slot), static_cast<uint32_t>(stages));
}

// caches        list of contiguous [num_pages, page_size, ...] tensors, any dtype; per layer the row
//               (trailing dims) and dtype may differ, num_pages and page_size may not
// page_table    [B, max_pages] int32, last dim contiguous
// prefix_lens   [B] int32, contiguous, mutated
// accept_nodes  [B, width] int32, contiguous, any width >= 1
// accept_len    [B] int32, contiguous
void kv_accept_cuda(const at::TensorList caches, const at::Tensor& page_table, const at::Tensor& prefix_lens,
                    const at::Tensor& accept_nodes, const at::Tensor& accept_len) {
  TORCH_CHECK_TYPE(!caches.empty(),
                   "caches must be a non-empty list of per-layer cache tensors [num_pages, page_size, ...]");
  const at::Tensor& first = caches[0];
  TORCH_CHECK_VALUE(first.dim() >= 3, "caches[0] must have shape (num_pages, page_size, ...), got ", first.sizes());
  CHECK_CUDA(first);
  const int64_t num_pages = first.size(0), page_size = first.size(1);
  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& c = caches[i];
    TORCH_CHECK_VALUE(c.device() == first.device(), "caches[", i, "] must be on the same device as caches[0] (",
                      first.device(), "), got ", c.device());
    TORCH_CHECK_VALUE(c.dim() >= 3 && c.size(0) == num_pages && c.size(1) == page_size, "caches[", i,
                      "] must have shape (num_pages, page_size, ...) = (", num_pages, ", ", page_size,
                      ", ...) like caches[0], got ", c.sizes());
    TORCH_CHECK_VALUE(c.is_contiguous(), "caches[", i, "] must be contiguous");
  }
  CHECK_DTYPE(page_table, at::kInt);
  CHECK_DIM(page_table, 2);
  TORCH_CHECK_VALUE(page_table.device() == first.device(), "page_table must be on the same device as caches[0] (",
                    first.device(), "), got ", page_table.device());
  TORCH_CHECK_VALUE(page_table.size(1) <= 1 || page_table.stride(1) == 1,
                    "page_table must be contiguous in its last dimension, got strides ", page_table.strides());
  const int64_t B = page_table.size(0);
  CHECK_DTYPE(prefix_lens, at::kInt);
  CHECK_SHAPE(prefix_lens, B);
  TORCH_CHECK_VALUE(prefix_lens.device() == first.device(), "prefix_lens must be on the same device as caches[0] (",
                    first.device(), "), got ", prefix_lens.device());
  TORCH_CHECK_VALUE(prefix_lens.is_contiguous(), "prefix_lens must be contiguous");
  CHECK_DTYPE(accept_nodes, at::kInt);
  CHECK_DIM(accept_nodes, 2);
  TORCH_CHECK_VALUE(accept_nodes.device() == first.device(), "accept_nodes must be on the same device as caches[0] (",
                    first.device(), "), got ", accept_nodes.device());
  TORCH_CHECK_VALUE(accept_nodes.is_contiguous(), "accept_nodes must be contiguous, got strides ",
                    accept_nodes.strides());
  const int64_t W = accept_nodes.size(1);
  CHECK_SHAPE(accept_nodes, B, W);
  TORCH_CHECK_VALUE(W > 0, "accept_nodes must have W >= 1 columns");
  CHECK_DTYPE(accept_len, at::kInt);
  CHECK_SHAPE(accept_len, B);
  TORCH_CHECK_VALUE(accept_len.device() == first.device(), "accept_len must be on the same device as caches[0] (",
                    first.device(), "), got ", accept_len.device());
  TORCH_CHECK_VALUE(accept_len.is_contiguous(), "accept_len must be contiguous");
  TORCH_CHECK_VALUE(B * kMaxCluster < (int64_t{1} << 31), "page_table has too many requests: B = ", B);
  if (B == 0) return;

  // Layers with the same row layout share a launch (the kernel assumes one unit width and row length):
  // for MLA or uniform K / V caches that is a single launch for all layers.
  std::vector<Group> groups;
  for (const at::Tensor& c : caches) {
    int64_t row_elems = 1;
    for (int64_t d = 2; d < c.dim(); ++d) row_elems *= c.size(d);
    const int64_t row_bytes = row_elems * static_cast<int64_t>(c.element_size());
    if (row_bytes == 0 || c.numel() == 0) continue;  // nothing to move in this layer
    const auto addr = reinterpret_cast<uintptr_t>(c.data_ptr());
    int width = 16;
    while (width > 1 && (row_bytes % width != 0 || addr % width != 0)) width /= 2;
    const int64_t vpr = row_bytes / width;
    TORCH_CHECK_VALUE(vpr * kMaxLayers < (int64_t{1} << 24), "caches rows must be shorter than ",
                      ((int64_t{1} << 24) / kMaxLayers) * width, " bytes on CUDA, got ", row_bytes);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.width == width && g.vpr == vpr; });
    if (it == groups.end()) {
      groups.push_back(Group{width, vpr, {}});
      it = groups.end() - 1;
    }
    it->bases.push_back(c.data_ptr());
  }
  if (groups.empty()) groups.push_back(Group{16, 1, {}});  // no bytes to move: only advance prefix_lens

  const c10::cuda::OptionalCUDAGuard guard(first.device());
  const int device = first.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Requests r{B, page_table.data_ptr<int32_t>(), page_table.stride(0),
                   std::min<int64_t>(page_table.size(1) * page_size, INT32_MAX), prefix_lens.data_ptr<int32_t>(),
                   accept_nodes.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(), W,
                   static_cast<int>(std::min<int64_t>(W, kMaxRows)), page_size, num_pages,
                   device_error_word(device)};
  // Clusters, and the bulk path (cp.async.bulk, mbarrier transaction counts), need sm_90 code (hopper()).
  const bool hopper_code = hopper(device);
  const int64_t want = (4 * num_sms(device) + B - 1) / B;
  const int C = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(hopper_code ? kMaxCluster : 1, want)));
  size_t launches = 0;
  for (const Group& g : groups) launches += std::max<size_t>(1, (g.bases.size() + kMaxLayers - 1) / kMaxLayers);
  size_t done = 0;
  for (const Group& g : groups) {
    for (size_t firstl = 0; firstl < std::max<size_t>(1, g.bases.size()); firstl += kMaxLayers) {
      const size_t count = std::min<size_t>(kMaxLayers, g.bases.size() - std::min(firstl, g.bases.size()));
      const bool advance = ++done == launches;  // the last launch advances prefix_lens (stream order)
      if (g.width == 16 && hopper_code) {
        launch_bulk(g, firstl, count, C, r, device, advance, stream);
        continue;
      }
      auto go = [&](auto unit_tag) {
        launch<decltype(unit_tag)>(g, firstl, count, C, hopper_code ? C : 0, r, advance, stream);
      };
      switch (g.width) {
        case 16: go(uint4{}); break;
        case 8: go(uint2{}); break;
        case 4: go(uint32_t{}); break;
        case 2: go(uint16_t{}); break;
        default: go(uint8_t{}); break;
      }
    }
  }
  after_launch(device, stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("kv_accept", &eagle3::kv_accept_cuda); }
