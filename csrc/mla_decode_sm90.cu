// tree_attention_mla's Hopper kernel (sm_90a), mla_decode_kernel: its builds and the sm_90a probe. What it computes
// and how (the work decomposition, inside a block), its H200 figures and its bad-value contract: eagle3/mla_sm90.h;
// the ops' host side (checks, launch, registration): csrc/mla_decode_sm90_host.cu.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "eagle3/errors.cuh"
#include "eagle3/mla_sm90.cuh"
#include "eagle3/wgmma.cuh"

namespace eagle3 {
namespace {

using namespace mla_sm90;  // the tile sizes, Params and the device helpers (eagle3/mla_sm90.h, mla_sm90.cuh)

#ifdef EAGLE3_DEV_BUILD
#pragma nv_diagnostic push
#pragma nv_diag_suppress 128  // (the no-math builds end their loops' bodies early: "loop is not reachable")
#endif
// kEvictFirst: the KV loads carry an L2 evict-first policy (else plain cp.async). kDev: 0, or a development
// build (EAGLE3_DEV_BUILD only: eagle3/mla_sm90.h).
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
      sm90::cp_async16_hint(dst, src ? src : kv, src ? 16 : 0, policy);
    } else if constexpr (kEvictFirst) {
      sm90::cp_async16_hint(dst, src ? src : kv, src ? 16 : 0, policy);
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
    sm90::sts128(dst + sm90::swizzle128(r, 2 * fj), h[0], h[1], h[2], h[3]);
    sm90::sts128(dst + sm90::swizzle128(r, 2 * fj + 1), h[4], h[5], h[6], h[7]);
  };
  auto convert_tile = [&](uint32_t stage) {
    uint32_t raw[4];
#pragma unroll
    for (int c = 0; c < 6; ++c) {
      if (c == 4) sm90::named_barrier_sync(5, 128);  // every thread's inputs 0-3 read
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        sm90::lds128(stage + kF8Base + c * 4096 + (fi + 128 * i) * 16, raw);
        f8_convert_chunk(stage, c, raw, i);
      }
    }
    uint32_t held[3][2][4];
#pragma unroll
    for (int c = 6; c < 9; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i) sm90::lds128(stage + kF8Base + c * 4096 + (fi + 128 * i) * 16, held[c - 6][i]);
    }
    sm90::named_barrier_sync(5, 128);  // every thread's inputs 4-8 read
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
          sm90::lds128(s_q + (tid + kThreads * k) * 16, v);
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
          sm90::lds128(addr, v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[e]));
            h[e] = Pack2<__half>::pack(f.x * down, f.y * down);
          }
          sm90::sts128(addr, h[0], h[1], h[2], h[3]);
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
      sm90::named_barrier_sync_unaligned(3, kThreads);  // tile t landed for every thread
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
        if (refills(t)) sm90::named_barrier_arrive(4, kThreads);
      }
#ifdef EAGLE3_DEV_BUILD
      if constexpr ((kDev & kDevNoMath) != 0) {
        sm90::named_barrier_sync(2, kThreads);
        sm90::named_barrier_arrive(1, kThreads);
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
      sm90::named_barrier_sync(2, kThreads);  // warpgroup 1 is done reading the previous P
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
      sm90::named_barrier_arrive(1, kThreads);  // P and the rescale factors are in shared memory
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
      sm90::named_barrier_sync_unaligned(3, kThreads);
      const uint32_t stage = s_k + (t & 1) * kTileBytes;
      const uint32_t next = s_k + ((t + 1) & 1) * kTileBytes;
      sm90::wgmma_wait<0>();  // this warpgroup's P V of tile t - 1 is done:
      sm90::fence_operand(o);
      sm90::named_barrier_arrive(2, kThreads);  // P and the rescale factors may be overwritten
      if (refills(t)) {  // refill the stage of tile t - 1 (page ids read an iteration ago)
        if constexpr (kFp8) {
          f8_issue(f8_src, next);  // its upper half: only this warpgroup's P V of tile t - 1 read it
        } else {
          load_own_chunks(next);
          sm90::named_barrier_sync(4, kThreads);
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
      sm90::named_barrier_sync(1, kThreads);
#ifdef EAGLE3_DEV_BUILD
      if constexpr ((kDev & kDevNoMath) != 0) continue;
#endif
      const float alpha[2] = {s_alpha[r0], s_alpha[r0 + 8]};
      rescale(alpha);
      pv(stage);
      if constexpr (kFp8) {
        if (t + 1 < n_tiles) {
          sm90::cp_async_wait_all();  // this thread's bytes of tile t + 1
          if (t >= 1) sm90::named_barrier_sync(4, kThreads);  // warpgroup 0's P V of tile t - 1 is done
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

}  // namespace

namespace mla_sm90 {

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

// mla_decode_kernel's builds (eagle3/mla_sm90.h), instantiated here, where the template is.
Kernel kernel_for(bool bf16, bool evict_first, bool fp8) {
  if (fp8) return bf16 ? mla_decode_kernel<__nv_bfloat16, false, 0, true> : mla_decode_kernel<__half, false, 0, true>;
  if (bf16) return evict_first ? mla_decode_kernel<__nv_bfloat16, true> : mla_decode_kernel<__nv_bfloat16, false>;
  return evict_first ? mla_decode_kernel<__half, true> : mla_decode_kernel<__half, false>;
}

#ifdef EAGLE3_DEV_BUILD
Kernel dev_kernel_for(bool evict_first, bool traced, int64_t skeleton) {
  using bf16 = __nv_bfloat16;
  if (skeleton == 1) return mla_decode_kernel<bf16, true, kDevNoMath>;
  if (skeleton == 3) return mla_decode_kernel<bf16, true, kDevNoMath | kDevNoStores>;
  if (traced) return evict_first ? mla_decode_kernel<bf16, true, kDevTrace> : mla_decode_kernel<bf16, false, kDevTrace>;
  return evict_first ? mla_decode_kernel<bf16, true> : mla_decode_kernel<bf16, false>;
}
#endif

}  // namespace mla_sm90
}  // namespace eagle3
