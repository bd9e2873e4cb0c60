// tree_attention_mla's Hopper kernel (sm_90a): absorbed-MLA tree-verify / decode attention, 576-dim keys
// (512 latent + 64 rope), V = the first 512 dims of the same rows, over a paged cache. Called by the
// CUDA launcher of torch.ops.eagle3.tree_attention_mla (triton_kernels/tree_attention.py), which checks
// the arguments, picks the split count and merges the splits (merge_splits); the op's semantics, bad
// values included, are eagle3_ops.reference.tree_attention_mla's.
//
// Work decomposition (as the Triton kernels): a block owns 64 query rows - (node, head) pairs, node-major,
// so at Kimi's 64 heads one block is one tree node's heads - of one request, and one split of its prefix
// (whole 64-key tiles); the last split also takes the N tree keys at prefix + node, masked by the ancestor
// bits. With more than one split each block writes a normalised fp32 partial and its log2-sum-exp2.
//
// Inside a block (FlashMLA's division of labour, written with wgmma directly):
//  - 64-key tiles are gathered with cp.async (a page-table lookup per key row, so any page size works;
//    invalid rows are zero-filled, never read) into 128-byte-swizzled shared memory, two stages; Q (64 x
//    576) and the first two tiles by all 256 threads (every page id read before the first load is issued),
//    every later tile by warpgroup 1 into the stage the tile before last freed, with its page ids read one
//    iteration ahead; with splits the KV loads are marked L2 evict-first, so the partials stay in L2 for
//    the merge;
//  - warpgroup 0 computes S = Q K^T (36 wgmma m64n64k16) once its P V of the previous tile is done (that
//    stage is then released for the refill), masks it, runs the online softmax, and writes P (bf16 / fp16)
//    and the rows' rescale factors to shared memory;
//  - both warpgroups rescale and accumulate their half of O (64 x 256 fp32 each, 128 registers a thread):
//    O_half += P V_half, 4 wgmma m64n256k16 with V read transposed from the same key tile.
// On the H200 (bench/results/tree_attention_sm90_release_h200.log): 16-node trees at 64-69% of the bf16
// matmul rate, N 1 at B 32 at 81% of the copy rate over the KV bytes, N 1 at B 1 at 35% - bound by the
// tiles' work, not the bytes: 23.9 us with its KV in L2 against 26.5 us from HBM (bench/dev/ceiling_mla.py,
// results/mla_ceiling_h200.log; where its time goes: bench/dev/trace_mla.py, results/mla_sm90_early_h200.log);
// 1.5x the Triton kernel.
// Bad values (eagle3_ops.reference.tree_attention_mla's contract): a request whose prefix length is outside
// [0, capacity - N] reads nothing, page ids outside [0, num_pages) are never dereferenced (only the page-table
// slots covering positions [0, prefix + N) are read), and such a request gets NaN in all its rows of out and
// lse; the value is recorded in the device error word (eagle3/errors.h) on the existing bad-value paths.
//
// A build without sm_90a (TORCH_CUDA_ARCH_LIST=9.0, or other archs only) compiles the kernel's body to a
// trap: the launcher refuses such a build (sm90a_compiled) before any launch, and the Python launcher then
// takes the Triton kernel (triton_kernels/mla_decode.py sm90_compiled).
//
// Development builds only (setup.py EAGLE3_DEV_BUILD=1, `#ifdef EAGLE3_DEV_BUILD` below): the private op
// _tree_attention_mla_sm90_dev runs the same kernel built with a per-block trace or as a no-math skeleton
// (kDev); a production build compiles neither, and its op table has no such arguments.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "eagle3/checks.h"
#include "eagle3/device.h"
#include "eagle3/errors.cuh"
#include "eagle3/wgmma.cuh"

namespace eagle3 {
namespace {

constexpr int kRows = 64;                            // query rows a block
constexpr int kKeys = 64;                            // keys a tile
constexpr int kDim = 576;                            // key width: 512 latent + 64 rope
constexpr int kDv = 512;                             // V = the first 512 dims
constexpr int kChunks = kDim / 64;                   // 128-byte column chunks a row
constexpr int kChunkBytes = kRows * 128;             // one [64 x 64] swizzled chunk
constexpr int kTileBytes = kChunks * kChunkBytes;    // Q, and each key stage: 73,728 bytes
constexpr int kPBytes = kRows * kKeys * 2;           // P: one chunk
constexpr int kThreads = 256;                        // two warpgroups
constexpr int kSmemBytes = 3 * kTileBytes + kPBytes + 3 * kRows * 4 + 1024;  // + alpha, l, m; + alignment
static_assert(kKeys == 64 && kRows == 64, "the tile code assumes 64 x 64 score tiles");

struct Params {
  const void* q;              // [B * N, G, 576] strides (stride_qt, stride_qh, 1)
  const void* kv;             // [num_pages, page_size, 576] strides (stride_kp, stride_ks, 1)
  const int32_t* page_table;  // [B, max_pages] strides (stride_pt, 1)
  const int32_t* prefix_lens; // [B]
  const int32_t* tree_mask;   // [B, N, W] contiguous
  void* out;                  // [B * N, G, 512] strides (stride_ot, stride_oh, 1)   (one split)
  float* lse;                 // [B * N, G] contiguous, natural log, or nullptr          (one split)
  float* part_out;            // [splits, B, N * G, 512] fp32 contiguous              (splits > 1)
  float* part_lse;            // [splits, B, N * G] fp32, log2 units                  (splits > 1)
#ifdef EAGLE3_DEV_BUILD
  uint64_t* trace;            // [blocks, kTraceSlots] (kDevTrace builds only)
#endif
  int64_t* err;               // the device error word (eagle3/errors.h)
  float scale_log2;
  int B, N, W, G, num_pages, max_pages, page_size, num_splits;
  int64_t stride_qt, stride_qh, stride_kp, stride_ks, stride_pt, stride_ot, stride_oh;
  const float* kv_scale;      // [1] fp32: an fp8 cache's dequantisation scale (kFp8 builds), else nullptr
  int evict_first;            // kFp8 builds: the KV loads' L2 policy, evict-first (1) or normal (0)
};

template <typename T>
struct Pack2;
template <>
struct Pack2<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Pack2<__half> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <typename T>
__device__ __forceinline__ void mma_qk(float (&s)[32], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    sm90::wgmma_m64n64k16_bf16<0>(s, da, db, scale_d);
  } else {
    sm90::wgmma_m64n64k16_f16<0>(s, da, db, scale_d);
  }
}

template <typename T>
__device__ __forceinline__ void mma_pv(float (&o)[128], uint64_t da, uint64_t db) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    sm90::wgmma_m64n256k16_bf16<1>(o, da, db, 1);
  } else {
    sm90::wgmma_m64n256k16_f16<1>(o, da, db, 1);
  }
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

#ifdef EAGLE3_DEV_BUILD
// The development builds (kDev, a bit set; production kernels are kDev = 0 and compile none of this):
//  - kDevTrace (bench/dev/trace_mla.py): per block, the SM, then %globaltimer (ns) at entry, when Q and tile 0
//    have landed, when each later tile t (1 .. 8) has landed, after the last wgmma and after the epilogue;
//  - kDevNoMath (bench/dev/ceiling_mla.py): all the math dropped (Q K^T, the softmax, P V: the loads, barriers
//    and epilogue stay); with kDevNoStores the epilogue's stores too: what is left is this decomposition's floor.
constexpr int kDevNoMath = 1, kDevNoStores = 2, kDevTrace = 4;
constexpr int kTraceSlots = 16;
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// 2^x by the MUFU alone: results below 2^-126 flush to 0 (exp2f adds a denormal-range fix-up, 3 more
// instructions for each of the 32 a thread computes per tile). Arguments are score - row max <= 0, so only
// probabilities under 2^-126 of the row's largest (which is 1) are flushed: nothing next to it in l or in P V.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16 bytes global -> shared with an L2 cache policy (createpolicy): the KV rows are read once
__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, uint32_t src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}

// kFp8: 16 e4m3 values (16 bytes, the order they sit in memory) -> 16 fp16 values, exactly (every e4m3 value,
// subnormals and NaN included, is an fp16 value): 8 cvt.rn.f16x2.e4m3x2, two values each.
__device__ __forceinline__ void e4m3x16_to_f16(const uint32_t (&in)[4], uint32_t (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out[2 * i]), "=r"(out[2 * i + 1])
        : "r"(in[i]));
  }
}
__device__ __forceinline__ void lds128(uint32_t addr, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Named barrier `id` over `threads` threads: the producer arrives (does not wait), the consumer syncs.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same for a barrier that both warpgroups wait on from their own code (barrier 3): bar.sync is PTX's aligned
// form, which promises that every thread blocking in one generation executes the same barrier instruction, and two
// warpgroups waiting at two sites break that promise (compute-sanitizer synccheck: "Divergent thread(s) in block",
// seen at 3987bd8 on the H200); barrier.sync without .aligned allows it.
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The error path of a poisoned block of request b (every thread of the block calls it): a bad prefix length
// (reported by thread 0), else each page-table slot this block read - those covering this split's prefix keys
// [start, end) and, in the last split (tree_n = N), the tree keys [prefix, prefix + N) - whose page id is
// outside [0, num_pages), as row_src found them (the first report wins).
__device__ __noinline__ void report_request(int64_t* err, const int32_t* pt_row, int num_pages, int page_size, int b,
                                            bool bad, int prefix_raw, int64_t clamp_hi, int64_t start, int64_t end,
                                            int prefix, int tree_n) {
  if (bad) {
    if (threadIdx.x == 0) report_range(err, kOpTreeAttentionMla, kArgPrefixLens, prefix_raw, 0, clamp_hi, b);
    return;
  }
  auto scan = [&](int64_t lo, int64_t hi) {  // the slots of positions [lo, hi)
    if (hi <= lo) return;
    for (int64_t slot = lo / page_size + threadIdx.x; slot <= (hi - 1) / page_size; slot += blockDim.x) {
      const int page = pt_row[slot];
      if (page < 0 || page >= num_pages) {
        report_range(err, kOpTreeAttentionMla, kArgPageTable, page, 0, num_pages - 1, b, slot);
      }
    }
  };
  scan(start, end);
  scan(prefix, static_cast<int64_t>(prefix) + tree_n);
}

#ifdef EAGLE3_DEV_BUILD
#pragma nv_diagnostic push
#pragma nv_diag_suppress 128  // (the no-math builds end their loops' bodies early: "loop is not reachable")
#endif
// kEvictFirst: the KV loads carry an L2 evict-first policy (else plain cp.async). kDev: 0, or a development
// build (EAGLE3_DEV_BUILD only, above).
// kFp8: false, a cache of T; true, the cache is fp8 e4m3 (T is q's and out's dtype; the dots run in fp16: kFp8's
// notes below).
template <typename T, bool kEvictFirst, int kDev = 0, bool kFp8 = false>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = sm90::smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;  // swizzle atoms are 1024-byte aligned
  uint8_t* smem = smem_raw + pad;
  const uint32_t s_q = raw + pad;
  const uint32_t s_k = s_q + kTileBytes;  // stage s at s_k + s * kTileBytes
  const uint32_t s_p = s_q + 3 * kTileBytes;
  uint8_t* p_tile = smem + 3 * kTileBytes;
  float* s_alpha = reinterpret_cast<float*>(smem + 3 * kTileBytes + kPBytes);
  float* s_l = s_alpha + kRows;
  float* s_m = s_l + kRows;

  const int tid = threadIdx.x;
  const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int m_block = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
#ifdef EAGLE3_DEV_BUILD
  uint64_t* trace = nullptr;
  if constexpr ((kDev & kDevTrace) != 0) {
    trace = p.trace + ((static_cast<int64_t>(split) * gridDim.y + b) * gridDim.x + m_block) * kTraceSlots;
    if (tid == 0) {
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      trace[0] = sm;
      trace[1] = global_ns();
    }
  }
#endif
  const int rows_total = p.N * p.G;
  const T* q = static_cast<const T*>(p.q);
  using KT = std::conditional_t<kFp8, uint8_t, T>;  // a cache element
  using MT = std::conditional_t<kFp8, __half, T>;   // the wgmmas' inputs (Q, K, P, V in shared memory)
  const KT* kv = static_cast<const KT*>(p.kv);
  // kFp8: the scale, read on the device (a graph replays with whatever it holds); not finite and > 0: every row
  // NaN and the value reported (the reference raises)
  const float kv_scale = kFp8 ? *p.kv_scale : 1.f;
  const bool bad_scale = kFp8 && !(kv_scale > 0.f && kv_scale <= 3.402823466e38f);
  float qk_scale = p.scale_log2;  // the scores' factor to log2 units (kFp8: times kv_scale and Q's 2^shift)

  // This split's keys (tree_attention.py _request_span): whole 64-key tiles of the clamped prefix.
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page_size;
  const int prefix_raw = p.prefix_lens[b];
  const bool bad = prefix_raw < 0 || prefix_raw > capacity - p.N;
  const int64_t clamp_hi = capacity - p.N;
  const int prefix =
      static_cast<int>(clamp_hi < 0 ? 0 : (prefix_raw < clamp_hi ? (prefix_raw < 0 ? 0 : prefix_raw) : clamp_hi));
  const int64_t per_split = (static_cast<int64_t>(prefix) + p.num_splits - 1) / p.num_splits;  // (no int overflow)
  const int64_t chunk = (per_split + kKeys - 1) / kKeys * kKeys;
  const int64_t start = split * chunk;
  const int64_t end = start + chunk < prefix ? start + chunk : static_cast<int64_t>(prefix);
  const int n_prefix_tiles = end > start ? static_cast<int>((end - start + kKeys - 1) / kKeys) : 0;
  // a bad prefix length: no tile at all (nothing read; the epilogue writes NaN rows)
  const int n_tiles = bad ? 0 : n_prefix_tiles + (split == p.num_splits - 1 ? cdiv(p.N, kKeys) : 0);
  const int32_t* pt_row = p.page_table + b * p.stride_pt;

  // Where key row r of tile t lives, or nullptr where it must not be read (past the split, past the tree,
  // on a page id outside [0, num_pages): those rows are zero-filled; the latter also poison the request, and
  // report_request finds and reports them after the epilogue: nothing waits on a page id before its loads).
  bool unreal = false;
  auto row_src = [&](int t, int r) -> const KT* {
    int64_t pos;
    bool valid;
    if (t < n_prefix_tiles) {
      pos = start + static_cast<int64_t>(t) * kKeys + r;
      valid = pos < end;
    } else {
      const int j = (t - n_prefix_tiles) * kKeys + r;
      pos = static_cast<int64_t>(prefix) + j;
      valid = j < p.N && pos < capacity;
    }
    // positions < capacity < 2^31 (the launcher checks): 32-bit division
    const uint32_t upos = static_cast<uint32_t>(pos), ups = static_cast<uint32_t>(p.page_size);
    const uint32_t pg = upos / ups;
    const int page = valid ? pt_row[pg] : 0;
    const bool real = static_cast<uint32_t>(page) < static_cast<uint32_t>(p.num_pages);  // 0 <= page < num_pages
    unreal |= valid && !real;
    return valid && real ? kv + page * p.stride_kp + static_cast<int64_t>(upos - pg * ups) * p.stride_ks : nullptr;
  };
  uint64_t policy = 0;
  if constexpr (kEvictFirst) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  if constexpr (kFp8) {  // (a runtime policy: one build serves both)
    if (p.evict_first) {
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    } else {
      asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    }
  }
  auto kv_load = [&](uint32_t dst, const KT* src) {
    if constexpr (kFp8) {
      cp_async16_hint(dst, src ? src : kv, src ? 16 : 0, policy);
    } else if constexpr (kEvictFirst) {
      cp_async16_hint(dst, src ? src : kv, src ? 16 : 0, policy);
    } else {
      sm90::cp_async16(dst, src ? src : kv, src ? 16 : 0);
    }
  };
  // The first tiles (and Q): every thread, rows lr and lr + 32, 16-byte chunk lc of each of the 9 column
  // chunks (8 threads read a row's 128-byte column chunk together).
  const int lr = tid / 8, lc = tid % 8;
  auto tile_srcs = [&](int t, const KT* (&src)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) src[i] = row_src(t, lr + 32 * i);
  };
  auto issue_tile = [&](const KT* const (&src)[2], uint32_t stage) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t dst = stage + sm90::swizzle128(lr + 32 * i, lc);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        kv_load(dst + c * kChunkBytes, src[i] ? src[i] + c * 64 + lc * 8 : nullptr);
      }
    }
  };
  // Later tiles: warpgroup 1 loads them (its own work is the smaller half), 16 threads a pass over rows wr,
  // wr + 16, wr + 32, wr + 48: first the chunks only its P V reads (4-7), as soon as that P V is done, then
  // chunks 0-3 and the rope chunk 8 once warpgroup 0 says its P V is done (barrier 4).
  const int wr = (tid % 128) / 8;
  const KT* rows_src[4];
  auto refill_srcs = [&](int t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) rows_src[i] = row_src(t, wr + 16 * i);
  };
  auto load_own_chunks = [&](uint32_t stage) {  // of the tile refill_srcs named
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = wr + 16 * i;
      const uint32_t dst = stage + sm90::swizzle128(r, lc);
#pragma unroll
      for (int c = 4; c < 8; ++c) {
        kv_load(dst + c * kChunkBytes, rows_src[i] ? rows_src[i] + c * 64 + lc * 8 : nullptr);
      }
    }
  };
  auto load_other_chunks = [&](uint32_t stage) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t dst = stage + sm90::swizzle128(wr + 16 * i, lc);
#pragma unroll
      for (int k = 0; k < 5; ++k) {
        const int c = k < 4 ? k : 8;
        kv_load(dst + c * kChunkBytes, rows_src[i] ? rows_src[i] + c * 64 + lc * 8 : nullptr);
      }
    }
  };

  // kFp8: warpgroup 1 alone loads and converts every tile. Thread i (0..127) of it owns rows fr and fr + 32 and
  // the 16-byte piece fj of each row's 64-byte column chunk (4 threads a row chunk: whole 32-byte sectors). A
  // tile's 36,864 fp8 bytes land (cp.async) in the upper half of its bf16-sized stage, chunk-major: chunk c's
  // [64 rows x 64 bytes] at kF8Base + c * 4096, piece p = 4 r + fj at 16 p. The upper half is read only by
  // warpgroup 1's own P V (chunks 4-7) and by Q K^T (long done), so the bytes of tile t + 1 are issued as soon as
  // warpgroup 1's P V of tile t - 1 is done. convert_tile then expands the bytes in place into the 128-byte
  // swizzled fp16 layout the wgmmas read: the thread converts the pieces it loaded (no wait on other threads'
  // loads), output chunk c at c * 8192. Outputs 0-3 overlap no input; output 4 overlaps input chunk 0, output 5
  // inputs 1-2, output 6 inputs 3-4, output 7 inputs 5-6, output 8 inputs 7-8: so inputs 0-3 are converted and
  // written first, a barrier (5, warpgroup 1's 128 threads), inputs 4-5 converted and written, inputs 6-8 read,
  // a barrier, outputs 6-8 written. Barrier 4 (warpgroup 0's P V of the tile before is done: it reads output
  // chunks 0-3) comes before any write.
  constexpr uint32_t kF8Base = kTileBytes / 2;  // 36,864
  const int fi = tid % 128, fr = fi / 4, fj = fi % 4;
  const KT* f8_src[2];
  auto f8_srcs = [&](int t, const KT* (&src)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) src[i] = row_src(t, fr + 32 * i);
  };
  auto f8_issue = [&](const KT* const (&src)[2], uint32_t stage) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        kv_load(stage + kF8Base + c * 4096 + (fi + 128 * i) * 16, src[i] ? src[i] + c * 64 + fj * 16 : nullptr);
      }
    }
  };
  auto f8_convert_chunk = [&](uint32_t stage, int c, const uint32_t (&raw)[4], int i) {
    uint32_t h[8];
    e4m3x16_to_f16(raw, h);
    const uint32_t dst = stage + c * kChunkBytes;
    const int r = fr + 32 * i;
    sts128(dst + sm90::swizzle128(r, 2 * fj), h[0], h[1], h[2], h[3]);
    sts128(dst + sm90::swizzle128(r, 2 * fj + 1), h[4], h[5], h[6], h[7]);
  };
  auto convert_tile = [&](uint32_t stage) {
    uint32_t raw[4];
#pragma unroll
    for (int c = 0; c < 6; ++c) {
      if (c == 4) named_barrier_sync(5, 128);  // every thread's inputs 0-3 read
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        lds128(stage + kF8Base + c * 4096 + (fi + 128 * i) * 16, raw);
        f8_convert_chunk(stage, c, raw, i);
      }
    }
    uint32_t held[3][2][4];
#pragma unroll
    for (int c = 6; c < 9; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i) lds128(stage + kF8Base + c * 4096 + (fi + 128 * i) * 16, held[c - 6][i]);
    }
    named_barrier_sync(5, 128);  // every thread's inputs 4-8 read
#pragma unroll
    for (int c = 6; c < 9; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i) f8_convert_chunk(stage, c, held[c - 6][i], i);
    }
  };

  if (n_tiles > 0) {
    // every page id of the prologue's tiles first: their round trips overlap each other and Q's loads
    const KT* src0[2];
    const KT* src1[2] = {nullptr, nullptr};
    if (!kFp8 || wg == 1) {
      if constexpr (kFp8) {
        f8_srcs(0, src0);
        if (n_tiles > 1) f8_srcs(1, src1);
      } else {
        tile_srcs(0, src0);
        if (n_tiles > 1) tile_srcs(1, src1);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lr + 32 * i;
      const int row = m_block * kRows + r;
      const bool ok = row < rows_total;
      const int node = ok ? row / p.G : 0, head = ok ? row % p.G : 0;
      const T* src = q + (static_cast<int64_t>(b) * p.N + node) * p.stride_qt + head * p.stride_qh + lc * 8;
      const uint32_t dst = s_q + sm90::swizzle128(r, lc);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) sm90::cp_async16(dst + c * kChunkBytes, ok ? src + c * 64 : q, ok ? 16 : 0);
    }
    if constexpr (kFp8) {
      // Q in its own group, then (warpgroup 1) tile 0 into stage 0 and tile 1 into stage 1, a group each
      sm90::cp_async_commit();
      if (wg == 1) {
        f8_issue(src0, s_k);
        sm90::cp_async_commit();
        if (n_tiles > 1) f8_issue(src1, s_k + kTileBytes);
        sm90::cp_async_commit();
        if (n_tiles > 2) f8_srcs(2, f8_src);  // page ids an iteration ahead, as below
        sm90::cp_async_wait<2>();  // Q
      } else {
        sm90::cp_async_wait_all();
      }
      __syncthreads();  // Q landed for every thread
      int shift = 0;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // bf16 q -> fp16 in place, exact in fp16's normal range; a block whose Q holds |q| >= 2^15 is first scaled
        // by 2^-shift (exact), folded back into qk_scale, so nothing overflows fp16 (the Triton fp8 path's rule).
        // Only the block's rows of q are visited: the rows past them were zero-filled, and bf16 0 is fp16 0 (a
        // 16-byte unit u of Q is row (u % 512) / 8 of column chunk u / 512; 16 of 64 rows at 16 heads, N 1).
        const int q_rows = rows_total - m_block * kRows;  // (> 0; more than kRows in all but the last block)
        auto q_unit_used = [&](int u) { return (u % (kChunkBytes / 16)) / 8 < q_rows; };
        float amax = 0.f;
#pragma unroll
        for (int k = 0; k < kTileBytes / 16 / kThreads; ++k) {
          if (!q_unit_used(tid + kThreads * k)) continue;
          uint32_t v[4];
          lds128(s_q + (tid + kThreads * k) * 16, v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[e]));
            // the finite values only: a NaN or an infinity stays what it is in fp16 (as the reference has it) and
            // sets no shift, so the block's other rows keep their exact conversion
            const float ax = fabsf(f.x) <= 3.402823466e38f ? fabsf(f.x) : 0.f;
            const float ay = fabsf(f.y) <= 3.402823466e38f ? fabsf(f.y) : 0.f;
            amax = fmaxf(amax, fmaxf(ax, ay));
          }
        }
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o2));
        if (lane == 0) s_alpha[tid / 32] = amax;  // (s_alpha is free until the first softmax)
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, s_alpha[w]);
        if (amax >= 32768.f) {
          const uint32_t bits = __float_as_uint(amax);
          const int ceil_log2 = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u);
          shift = ceil_log2 - 15;  // amax * 2^-shift <= 2^15
        }
        const float down = __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);  // 2^-shift
#pragma unroll
        for (int k = 0; k < kTileBytes / 16 / kThreads; ++k) {
          if (!q_unit_used(tid + kThreads * k)) continue;
          const uint32_t addr = s_q + (tid + kThreads * k) * 16;
          uint32_t v[4], h[4];
          lds128(addr, v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[e]));
            h[e] = Pack2<__half>::pack(f.x * down, f.y * down);
          }
          sts128(addr, h[0], h[1], h[2], h[3]);
        }
      }
      qk_scale = p.scale_log2 * kv_scale * __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
      if (wg == 1) {
        sm90::cp_async_wait<1>();  // tile 0 (tile 1's group may still fly)
        convert_tile(s_k);
      }
      sm90::fence_proxy_async();  // Q's and tile 0's fp16 (st.shared) for the wgmmas
    } else {
      // tile 1 too: stage 1 is free from the start (a separate group; an empty one without a tile 1)
      issue_tile(src0, s_k);
      sm90::cp_async_commit();
      if (n_tiles > 1) issue_tile(src1, s_k + kTileBytes);
      sm90::cp_async_commit();
      if (wg == 1 && n_tiles > 2) refill_srcs(2);  // warpgroup 1 reads its refills' page ids an iteration ahead
    }
  }
  // This thread's two rows of every accumulator (wgmma layout): r0 and r0 + 8.
  const int r0 = warp * 16 + lane / 4;
  const int quad = lane % 4;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // warpgroup 0: running max and (partial) sum

  // The two warpgroups run separate loops (ptxas analyses each path alone). Per tile: a block barrier
  // (tile t landed, barrier 3); warpgroup 0 waits for its P V of tile t - 1, lets warpgroup 1 refill that
  // stage (barrier 4), issues S = Q K^T and waits for it, softmaxes, hands P over (barrier 1) and issues its
  // P V (before, Q K^T was issued right behind that P V and the stage released after both: 1-8% slower at 16
  // nodes, results/mla_sm90_release_h200.log); warpgroup 1 waits
  // for its own P V of tile t - 1, says P may be overwritten (barrier 2), loads tile t + 1 into the stage of
  // tile t - 1, takes P and issues its P V. (A wait_group 1 that lets Q K^T run on while the loads are
  // issued made ptxas serialise every wgmma, C7514.)
  auto pv = [&](uint32_t stage) {
    sm90::fence_operand(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t da = sm90::desc_sw128(s_p + k * 32, 16, 1024);
      const uint64_t db = sm90::desc_sw128(stage + wg * 4 * kChunkBytes + k * 16 * 128, kChunkBytes, 1024);
      mma_pv<MT>(o, da, db);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(o);
  };
  auto rescale = [&](const float (&alpha)[2]) {
    // (once a row's max settles its factor is exactly 1: most tiles skip the 128 multiplies)
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
  };
  // Tile 1 came with the prologue: warpgroup 1 refills from t = 1 on (tile t + 1 into the stage of t - 1).
  auto refills = [&](int t) { return t >= 1 && t + 1 < n_tiles; };
  auto wait_tile = [&](int t) {  // this thread's part of tile t has landed
    if constexpr (kFp8) {
      return;  // (kFp8: Q waited for in the prologue; warpgroup 1 waits for its tiles where it converts them)
    } else if (t == 0) {
      sm90::cp_async_wait<1>();  // (tile 1's group may still fly)
    } else {
      sm90::cp_async_wait_all();
    }
  };
  if (wg == 0) {
    for (int t = 0; t < n_tiles; ++t) {
      wait_tile(t);
      sm90::fence_proxy_async();
      named_barrier_sync_unaligned(3, kThreads);  // tile t landed for every thread
#ifdef EAGLE3_DEV_BUILD
      if constexpr ((kDev & kDevTrace) != 0) {
        if (tid == 0 && t <= 8) trace[2 + t] = global_ns();
      }
#endif
      const uint32_t stage = s_k + (t & 1) * kTileBytes;
      if (t > 0) {
        // P V of tile t - 1 done before Q K^T is issued: its stage is released a Q K^T earlier than after both
        // (the refill's chunks 0-3 and rope then have longer to land; results/mla_sm90_release_h200.log)
        sm90::wgmma_wait<0>();
        sm90::fence_operand(o);
        if (refills(t)) named_barrier_arrive(4, kThreads);
      }
#ifdef EAGLE3_DEV_BUILD
      if constexpr ((kDev & kDevNoMath) != 0) {
        named_barrier_sync(2, kThreads);
        named_barrier_arrive(1, kThreads);
        continue;
      }
#endif
      float s[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      sm90::fence_operand(s);
      sm90::wgmma_fence();
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint64_t da = sm90::desc_sw128(s_q + c * kChunkBytes + k * 32, 16, 1024);
          const uint64_t db = sm90::desc_sw128(stage + c * kChunkBytes + k * 32, 16, 1024);
          mma_qk<MT>(s, da, db, (c | k) != 0);
        }
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();  // S (this warpgroup's P V of tile t - 1 was waited for above)
      sm90::fence_operand(s);
      sm90::fence_operand(o);

      // mask the split's partial last tile and the tree block (raw scores: the scale, > 0, is applied below)
      if (t >= n_prefix_tiles) {
        const int j0 = (t - n_prefix_tiles) * kKeys;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m_block * kRows + r0 + 8 * h;
          const bool row_ok = row < rows_total;
          const int32_t* words = p.tree_mask + (static_cast<int64_t>(b) * p.N + (row_ok ? row / p.G : 0)) * p.W;
          const uint32_t lo = row_ok ? static_cast<uint32_t>(words[j0 / 32]) : 0u;
          const uint32_t hi = row_ok && j0 / 32 + 1 < p.W ? static_cast<uint32_t>(words[j0 / 32 + 1]) : 0u;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = 8 * j + 2 * quad + e;
              const uint32_t word = col < 32 ? lo : hi;
              const bool visible = j0 + col < p.N && prefix + j0 + col < capacity && ((word >> (col & 31)) & 1u);
              if (!visible) s[4 * j + 2 * h + e] = -INFINITY;
            }
          }
        }
      } else if (start + static_cast<int64_t>(t + 1) * kKeys > end) {
        const int64_t pos0 = start + static_cast<int64_t>(t) * kKeys;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (pos0 + 8 * j + 2 * quad + (e & 1) >= end) s[4 * j + e] = -INFINITY;
          }
        }
      }


      float alpha[2];
      named_barrier_sync(2, kThreads);  // warpgroup 1 is done reading the previous P
      // online softmax over the tile's 64 keys (a row's 64 scores sit in the 4 threads of a quad), in log2 units:
      // the max of the raw scores times the scale is the max of the scaled ones (scale > 0), and each
      // probability is one FFMA and one MUFU
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[h], mx * qk_scale);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen nothing stays at 0
        alpha[h] = fast_exp2(m_run[h] - m_use);
        m_run[h] = m_new;
        // The FFMA below takes the exact product of a score and the scale and subtracts the rounded max: for the
        // row's largest score that leaves the max's rounding error, up to half its ulp, in the exponent. Past
        // 2^15 in log2 units (|q| ~ 1e30, or scores no trained model makes) that error reaches 2^-9 and grows to
        // overflow (fp16 P) or to every probability flushed (l = 0, out NaN); there the scores are rounded first,
        // exactly as the max was, so the largest gives exp2(0) = 1. A compare and a branch per row otherwise.
        float q_use = qk_scale;
        if (fabsf(m_use) >= 32768.f) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            s[4 * j + 2 * h] = __fmul_rn(s[4 * j + 2 * h], qk_scale);
            s[4 * j + 2 * h + 1] = __fmul_rn(s[4 * j + 2 * h + 1], qk_scale);
          }
          q_use = 1.f;
        }
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float p0 = fast_exp2(fmaf(s[4 * j + 2 * h], q_use, -m_use));
          const float p1 = fast_exp2(fmaf(s[4 * j + 2 * h + 1], q_use, -m_use));
          sum += p0 + p1;
          const int r = r0 + 8 * h;
          *reinterpret_cast<uint32_t*>(p_tile + sm90::swizzle128(r, j) + quad * 4) = Pack2<MT>::pack(p0, p1);
        }
        l_run[h] = l_run[h] * alpha[h] + sum;
        if (quad == 0) s_alpha[r0 + 8 * h] = alpha[h];
      }
      sm90::fence_proxy_async();
      named_barrier_arrive(1, kThreads);  // P and the rescale factors are in shared memory
      rescale(alpha);
      pv(stage);
    }
  } else {
    // kFp8: tile t was converted at the end of iteration t - 1 (tile 0 in the prologue); warpgroup 1 issues tile
    // t + 1's bytes once its P V of tile t - 1 is done, and converts them while its P V of tile t runs.
    for (int t = 0; t < n_tiles; ++t) {
      if constexpr (!kFp8) {
        wait_tile(t);
        sm90::fence_proxy_async();
      }
      // tile t landed (kFp8: converted, each thread fenced) for every thread
      named_barrier_sync_unaligned(3, kThreads);
      const uint32_t stage = s_k + (t & 1) * kTileBytes;
      const uint32_t next = s_k + ((t + 1) & 1) * kTileBytes;
      sm90::wgmma_wait<0>();  // this warpgroup's P V of tile t - 1 is done:
      sm90::fence_operand(o);
      named_barrier_arrive(2, kThreads);  // P and the rescale factors may be overwritten
      if (refills(t)) {  // refill the stage of tile t - 1 (page ids read an iteration ago)
        if constexpr (kFp8) {
          f8_issue(f8_src, next);  // its upper half: only this warpgroup's P V of tile t - 1 read it
        } else {
          load_own_chunks(next);
          named_barrier_sync(4, kThreads);
          load_other_chunks(next);
        }
        sm90::cp_async_commit();
        if (t + 2 < n_tiles) {  // their round trip overlaps this tile's P V
          if constexpr (kFp8) {
            f8_srcs(t + 2, f8_src);
          } else {
            refill_srcs(t + 2);
          }
        }
      }
      named_barrier_sync(1, kThreads);
#ifdef EAGLE3_DEV_BUILD
      if constexpr ((kDev & kDevNoMath) != 0) continue;
#endif
      const float alpha[2] = {s_alpha[r0], s_alpha[r0 + 8]};
      rescale(alpha);
      pv(stage);
      if constexpr (kFp8) {
        if (t + 1 < n_tiles) {
          sm90::cp_async_wait_all();  // this thread's bytes of tile t + 1
          if (t >= 1) named_barrier_sync(4, kThreads);  // warpgroup 0's P V of tile t - 1 is done
          convert_tile(next);
          sm90::fence_proxy_async();
        }
      }
    }
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operand(o);
#ifdef EAGLE3_DEV_BUILD
  if constexpr ((kDev & kDevTrace) != 0) {
    if (tid == 0) trace[11] = global_ns();
  }
#endif

  // Row sums across each quad; the rows' (m, l) to shared memory for warpgroup 1.
  if (wg == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (quad == 0) {
        s_l[r0 + 8 * h] = l;
        s_m[r0 + 8 * h] = m_run[h];
      }
    }
  }
  const bool request_bad = __syncthreads_or(unreal) || bad;
  const bool poisoned = request_bad || bad_scale;  // (bad_scale: kFp8 only)
  const float poison = poisoned ? NAN : 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const int row = m_block * kRows + r;
    if (row >= rows_total) continue;
    const float l = s_l[r], m = s_m[r];
    // (kFp8: V = fp8 * kv_scale, the scale applied once a row, with the sum)
    const float inv = l > 0.f ? (kFp8 ? kv_scale / l : 1.f / l) : 1.f;
    const float lse2 = (l > 0.f ? m + log2f(l) : -INFINITY) + poison;
#ifdef EAGLE3_DEV_BUILD
    if constexpr ((kDev & kDevNoStores) != 0) continue;
#endif
    if (p.num_splits > 1) {
      const int64_t prow = (static_cast<int64_t>(split) * p.B + b) * rows_total + row;
      float* dst = p.part_out + prow * kDv + wg * (kDv / 2) + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) =
            make_float2(o[4 * j + 2 * h] * inv + poison, o[4 * j + 2 * h + 1] * inv + poison);
      }
      if (wg == 0 && quad == 0) p.part_lse[prow] = lse2;
    } else {
      const int node = row / p.G, head = row % p.G;
      const int64_t token = static_cast<int64_t>(b) * p.N + node;
      T* dst = static_cast<T*>(p.out) + token * p.stride_ot + head * p.stride_oh + wg * (kDv / 2) + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            Pack2<T>::pack(o[4 * j + 2 * h] * inv + poison, o[4 * j + 2 * h + 1] * inv + poison);
      }
      if (p.lse != nullptr && wg == 0 && quad == 0) p.lse[token * p.G + head] = lse2 * 0.6931471805599453f;
    }
  }
  if (kDeviceChecks && EAGLE3_UNLIKELY(poisoned)) {  // (block-uniform) after every store: nothing waits on it
    if (!kFp8 || request_bad) {  // a bad request reports first (the Triton fp8 path's order)
      report_request(p.err, pt_row, p.num_pages, p.page_size, b, bad, prefix_raw, clamp_hi, start, end, prefix,
                     split == p.num_splits - 1 ? p.N : 0);
    } else if (tid == 0) {
      report_float(p.err, kOpTreeAttentionMla, kArgKvScale, kKindNotPositive, kv_scale, kNoIndex);
    }
  }
#ifdef EAGLE3_DEV_BUILD
  if constexpr ((kDev & kDevTrace) != 0) {
    __syncthreads();
    if (tid == 0) trace[12] = global_ns();
  }
#endif
#elif defined(__CUDA_ARCH__)
  __trap();  // built for another architecture (TORCH_CUDA_ARCH_LIST without 9.0a): fail, never return garbage
#endif
}

#ifdef EAGLE3_DEV_BUILD
#pragma nv_diagnostic pop
#endif

// Compiled from this file into the same module as mla_decode_kernel, so the device runs the same build of both:
// static shared memory only where the code is sm_90a's (elsewhere mla_decode_kernel's body is the trap), which
// cudaFuncGetAttributes reports (sharedSizeBytes) without a launch. Never launched.
__global__ void sm90a_marker(int* sink) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ volatile int mark[4];
  mark[threadIdx.x % 4] = static_cast<int>(threadIdx.x);
  __syncthreads();
  if (sink != nullptr) *sink = mark[0];
#endif
}

// Whether the current device runs this build's real sm_90a kernel (asked once per device; no stream work).
bool sm90a_compiled(int device) {
  static std::atomic<int> known[64] = {};  // 0 not asked yet, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    cudaFuncAttributes attr{};
    const cudaError_t e = cudaFuncGetAttributes(&attr, sm90a_marker);
    if (e != cudaSuccess) (void)cudaGetLastError();  // no code for this device at all (not sticky)
    k = e == cudaSuccess && attr.sharedSizeBytes > 0 ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

// q           [B * N, G, 576]  bf16 | fp16, rows 16-byte aligned, last dim contiguous
// kv_cache    [num_pages, page_size, 576]  q's dtype (fp8 e4m3 with kv_scale), rows 16-byte aligned, last dim
//             contiguous
// kv_scale    (fp8 caches) [] or [1] fp32 on q's device: key = V source = fp8 * kv_scale
// page_table  [B, max_pages] int32, last dim contiguous;  prefix_lens [B] int32
// tree_mask   [B, N, W] int32 contiguous
// out         [B * N, G, 512]  q's dtype, last dim contiguous;  lse [B * N, G] fp32 contiguous, optional
// part_out    [num_splits, B, N * G, 512] fp32 contiguous;  part_lse [num_splits, B, N * G] fp32 contiguous
//             (written when num_splits > 1, then merged by the caller; unused otherwise)
void check_args(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale, const at::Tensor& out,
                const std::optional<at::Tensor>& lse, const at::Tensor& part_out, const at::Tensor& part_lse,
                int64_t num_splits, const at::Tensor* kv_scale_or_null = nullptr) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                   "q must have dtype bfloat16 | float16, got ", q.scalar_type());
  CHECK_CUDA(q);
  CHECK_DIM(q, 3);
  CHECK_DIM(tree_mask, 3);
  const int64_t B = tree_mask.size(0), N = tree_mask.size(1), W = tree_mask.size(2), G = q.size(1);
  CHECK_SHAPE(q, B * N, G, kDim);
  CHECK_LAST_DIM_CONTIGUOUS(q);
  CHECK_DTYPE(kv_cache, kv_scale_or_null != nullptr ? at::kFloat8_e4m3fn : q.scalar_type());
  CHECK_DIM(kv_cache, 3);
  if (kv_scale_or_null != nullptr) {
    const at::Tensor& kv_scale = *kv_scale_or_null;
    CHECK_DTYPE(kv_scale, at::kFloat);
    TORCH_CHECK_VALUE(kv_scale.numel() == 1 && kv_scale.dim() <= 1, "kv_scale must have shape [] or [1], got ",
                      kv_scale.sizes());
    CHECK_SAME_DEVICE(kv_scale, q);
  }
  CHECK_SHAPE(kv_cache, kv_cache.size(0), kv_cache.size(1), kDim);
  CHECK_LAST_DIM_CONTIGUOUS(kv_cache);
  CHECK_DTYPE(page_table, at::kInt);
  CHECK_DIM(page_table, 2);
  CHECK_SHAPE(page_table, B, page_table.size(1));
  TORCH_CHECK_VALUE(page_table.size(1) == 0 || page_table.stride(1) == 1,
                    "page_table must be contiguous in its last dimension, got strides ", page_table.strides());
  CHECK_DTYPE(prefix_lens, at::kInt);
  CHECK_SHAPE(prefix_lens, B);
  TORCH_CHECK_VALUE(prefix_lens.is_contiguous(), "prefix_lens must be contiguous");
  CHECK_DTYPE(tree_mask, at::kInt);
  TORCH_CHECK_VALUE(tree_mask.is_contiguous(), "tree_mask must be contiguous, got strides ", tree_mask.strides());
  TORCH_CHECK_VALUE(W * 32 >= N, "tree_mask must have W >= ceil(N / 32) words, got W = ", W, " for N = ", N);
  CHECK_DTYPE(out, q.scalar_type());
  CHECK_SHAPE(out, B * N, G, kDv);
  CHECK_LAST_DIM_CONTIGUOUS(out);
  if (lse.has_value()) {
    CHECK_DTYPE((*lse), at::kFloat);
    CHECK_SHAPE((*lse), B * N, G);
    TORCH_CHECK_VALUE(lse->is_contiguous(), "lse must be contiguous");
  }
  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 65535, "num_splits must be in [1, 65535], got ", num_splits);
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "scale must be finite and > 0, got ", scale);
  if (num_splits > 1) {
    CHECK_DTYPE(part_out, at::kFloat);
    CHECK_SHAPE(part_out, num_splits, B, N * G, kDv);
    TORCH_CHECK_VALUE(part_out.is_contiguous(), "part_out must be contiguous");
    CHECK_DTYPE(part_lse, at::kFloat);
    CHECK_SHAPE(part_lse, num_splits, B, N * G);
    TORCH_CHECK_VALUE(part_lse.is_contiguous(), "part_lse must be contiguous");
  }
  for (const at::Tensor* t : {&kv_cache, &page_table, &prefix_lens, &tree_mask, &out}) CHECK_SAME_DEVICE((*t), q);
  if (lse.has_value()) CHECK_SAME_DEVICE((*lse), q);
  if (num_splits > 1) {
    CHECK_SAME_DEVICE(part_out, q);
    CHECK_SAME_DEVICE(part_lse, q);
  }
  // 16-byte cp.async of every 576-wide row
  auto aligned = [](const at::Tensor& t, int64_t s0, int64_t s1) {
    const int64_t per16 = 16 / t.element_size();  // elements a 16-byte unit
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && s0 % per16 == 0 && s1 % per16 == 0;
  };
  TORCH_CHECK_VALUE(aligned(q, q.stride(0), q.stride(1)),
                    "q must have 16-byte aligned rows (data pointer and strides)");
  TORCH_CHECK_VALUE(aligned(kv_cache, kv_cache.stride(0), kv_cache.stride(1)),
                    "kv_cache must have 16-byte aligned rows (data pointer and strides)");
  TORCH_CHECK_VALUE(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                        reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
                    "out must have 4-byte aligned element pairs");
  TORCH_CHECK_VALUE(N * G <= (int64_t{1} << 30) && B <= 65535 && kv_cache.size(0) < (int64_t{1} << 31) &&
                        page_table.size(1) * kv_cache.size(1) < (int64_t{1} << 31),
                    "tree_attention_mla sizes out of the kernel's range");
}

using Kernel = void (*)(const Params);

// Launches `kernel` (one of mla_decode_kernel's builds, picked by the caller for q's dtype) on q's device, the
// arguments checked by check_args. trace: the kDevTrace build's buffer (development builds), else nullptr.
void launch(Kernel kernel, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
            const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale, const at::Tensor& out,
            const std::optional<at::Tensor>& lse, const at::Tensor& part_out, const at::Tensor& part_lse,
            int64_t num_splits, uint64_t* trace, const at::Tensor* kv_scale = nullptr, bool evict_first = false) {
  const int64_t B = tree_mask.size(0), N = tree_mask.size(1), W = tree_mask.size(2), G = q.size(1);
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const int device = q.get_device();
  TORCH_CHECK_VALUE(sm_major(device) == 9, "the sm_90a kernel needs a Hopper GPU (compute capability 9.x)");
  // (before the empty-input return: triton_kernels/mla_decode.py sm90_compiled asks with empty inputs)
  TORCH_CHECK_NOT_IMPLEMENTED(sm90a_compiled(device), "this build has no sm_90a code for tree_attention_mla's "
                              "Hopper kernel (TORCH_CUDA_ARCH_LIST without 9.0a compiles it to a trap)");
  if (B == 0 || N == 0 || G == 0) return;

  Params p{};
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.page_table = page_table.data_ptr<int32_t>();
  p.prefix_lens = prefix_lens.data_ptr<int32_t>();
  p.tree_mask = tree_mask.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.part_out = num_splits > 1 ? part_out.data_ptr<float>() : nullptr;
  p.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
#ifdef EAGLE3_DEV_BUILD
  p.trace = trace;
#else
  (void)trace;
#endif
  p.err = device_error_word(device);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.B = static_cast<int>(B);
  p.N = static_cast<int>(N);
  p.W = static_cast<int>(W);
  p.G = static_cast<int>(G);
  p.num_pages = static_cast<int>(kv_cache.size(0));
  p.max_pages = static_cast<int>(page_table.size(1));
  p.page_size = static_cast<int>(kv_cache.size(1));
  p.num_splits = static_cast<int>(num_splits);
  p.stride_qt = q.stride(0);
  p.stride_qh = q.stride(1);
  p.stride_kp = kv_cache.stride(0);
  p.stride_ks = kv_cache.stride(1);
  p.stride_pt = page_table.stride(0);
  p.stride_ot = out.stride(0);
  p.stride_oh = out.stride(1);
  p.kv_scale = kv_scale != nullptr ? kv_scale->data_ptr<float>() : nullptr;
  p.evict_first = evict_first ? 1 : 0;
  if (p.page_size == 0 || p.max_pages == 0) {
    p.max_pages = 0;  // capacity 0: every request is bad (NaN), nothing is read
    p.page_size = 1;
  }

  const dim3 grid(static_cast<unsigned>((N * G + kRows - 1) / kRows), static_cast<unsigned>(B),
                  static_cast<unsigned>(num_splits));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(device, stream);
}

// The arguments as check_args'. evict_first: the KV loads marked L2 evict-first (when num_splits > 1: the
// partials, written last and read by the merge, then stay in L2).
void tree_attention_mla_sm90_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                                  const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale,
                                  const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                  const at::Tensor& part_out, const at::Tensor& part_lse, int64_t num_splits,
                                  bool evict_first) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits);
  Kernel kernel;
  if (q.scalar_type() == at::kBFloat16) {
    kernel = evict_first ? mla_decode_kernel<__nv_bfloat16, true> : mla_decode_kernel<__nv_bfloat16, false>;
  } else {
    kernel = evict_first ? mla_decode_kernel<__half, true> : mla_decode_kernel<__half, false>;
  }
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         nullptr);
}

// The fp8 e4m3 cache (kv_scale: [] or [1] fp32 on q's device, key = fp8 * kv_scale); the other arguments as
// tree_attention_mla_sm90_cuda's. One build per q dtype; the L2 policy of the KV loads is a runtime choice.
void tree_attention_mla_sm90_fp8_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_scale,
                                      const at::Tensor& page_table, const at::Tensor& prefix_lens,
                                      const at::Tensor& tree_mask, double scale, const at::Tensor& out,
                                      const std::optional<at::Tensor>& lse, const at::Tensor& part_out,
                                      const at::Tensor& part_lse, int64_t num_splits, bool evict_first) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
             &kv_scale);
  const Kernel kernel = q.scalar_type() == at::kBFloat16 ? mla_decode_kernel<__nv_bfloat16, false, 0, true>
                                                          : mla_decode_kernel<__half, false, 0, true>;
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         nullptr, &kv_scale, evict_first);
}

#ifdef EAGLE3_DEV_BUILD
// The development op (setup.py EAGLE3_DEV_BUILD=1), bf16 only; the arguments as tree_attention_mla_sm90_cuda's, and
// trace     [grid blocks, 16] int64 contiguous: the kDevTrace build writes its stamps there (bench/dev/trace_mla.py)
// skeleton  0, or a no-math build (evict-first loads, no trace): 1 without the math, 3 without the math and the
//           epilogue's stores (kDevNoMath | kDevNoStores; bench/dev/ceiling_mla.py)
void tree_attention_mla_sm90_dev_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                                      const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale,
                                      const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                      const at::Tensor& part_out, const at::Tensor& part_lse, int64_t num_splits,
                                      bool evict_first, const std::optional<at::Tensor>& trace, int64_t skeleton) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16, "the development builds are built for bfloat16 only, got ",
                   q.scalar_type());
  const bool traced = trace.has_value();
  TORCH_CHECK_VALUE(skeleton == 0 || ((skeleton == 1 || skeleton == 3) && evict_first && !traced),
                    "skeleton must be 0, or 1 | 3 with evict_first and no trace, got ", skeleton);
  if (traced) {
    const int64_t B = tree_mask.size(0), N = tree_mask.size(1), G = q.size(1);
    const int64_t blocks = (N * G + kRows - 1) / kRows * B * num_splits;
    CHECK_DTYPE((*trace), at::kLong);
    CHECK_SHAPE((*trace), blocks, kTraceSlots);
    TORCH_CHECK_VALUE(trace->is_contiguous(), "trace must be contiguous");
    CHECK_SAME_DEVICE((*trace), q);
  }
  using bf16 = __nv_bfloat16;
  Kernel kernel;
  if (skeleton == 1) {
    kernel = mla_decode_kernel<bf16, true, kDevNoMath>;
  } else if (skeleton == 3) {
    kernel = mla_decode_kernel<bf16, true, kDevNoMath | kDevNoStores>;
  } else if (traced) {
    kernel = evict_first ? mla_decode_kernel<bf16, true, kDevTrace> : mla_decode_kernel<bf16, false, kDevTrace>;
  } else {
    kernel = evict_first ? mla_decode_kernel<bf16, true> : mla_decode_kernel<bf16, false>;
  }
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         traced ? reinterpret_cast<uint64_t*>(trace->data_ptr<int64_t>()) : nullptr);
}
#endif

}  // namespace
}  // namespace eagle3

// internal, Hopper only: the sm_90a kernel over an fp8 e4m3 cache (tree_attention_mla with kv_scale), called by
// triton_kernels/mla_decode.py's tree_attention_mla_sm90, which picks the splits and merges them. Defined here,
// beside its only kernel, so that builds without this file have no such op (mla_decode.sm90_supported asks).
TORCH_LIBRARY_FRAGMENT(eagle3, m) {
  m.def(
      "_tree_attention_mla_sm90_fp8(Tensor q, Tensor kv_cache, Tensor kv_scale, Tensor page_table, "
      "Tensor prefix_lens, Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) part_out, "
      "Tensor(d!) part_lse, int num_splits, bool evict_first=False) -> ()");
}

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("_tree_attention_mla_sm90", &eagle3::tree_attention_mla_sm90_cuda);
  m.impl("_tree_attention_mla_sm90_fp8", &eagle3::tree_attention_mla_sm90_fp8_cuda);
#ifdef EAGLE3_DEV_BUILD
  m.impl("_tree_attention_mla_sm90_dev", &eagle3::tree_attention_mla_sm90_dev_cuda);
#endif
}
