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
// Development builds only (setup.py EAGLE3_DEV_BUILD=1, `#ifdef EAGLE3_DEV_BUILD`): the private op
// _tree_attention_mla_sm90_dev runs the same kernel built with a per-block trace or as a no-math skeleton
// (kDev); a production build compiles neither, and its op table has no such arguments.
//
// Where it is (setup.py builds the two .cu files as the one kernel "mla_decode_sm90", its KERNEL_PARTS):
//   csrc/mla_decode_sm90.cu       mla_decode_kernel and its builds (kernel_for, dev_kernel_for), sm90a_marker and
//                                 sm90a_compiled: the template is instantiated there, in the file that defines it
//   csrc/mla_decode_sm90_host.cu  the ops' host side: check_args, launch, _tree_attention_mla_sm90 (_fp8, _dev)
//   eagle3/mla_sm90.h             this header: the tile sizes, Params, and the declarations the two files share
//   eagle3/mla_sm90.cuh           the kernel's device helpers (its wgmmas by input type, P's packing, the error path)
//   eagle3/wgmma.cuh              the sm_90a inline PTX (wgmma, descriptors, cp.async, named barriers, lds / sts)
//
// This header is C++ only (no CUDA header): both files include it.
#pragma once

#include <cstdint>

namespace eagle3 {
namespace mla_sm90 {

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

#ifdef EAGLE3_DEV_BUILD
// The development builds (kDev, a bit set; production kernels are kDev = 0 and compile none of this):
//  - kDevTrace (bench/dev/trace_mla.py): per block, the SM, then %globaltimer (ns) at entry, when Q and tile 0
//    have landed, when each later tile t (1 .. 8) has landed, after the last wgmma and after the epilogue;
//  - kDevNoMath (bench/dev/ceiling_mla.py): all the math dropped (Q K^T, the softmax, P V: the loads, barriers
//    and epilogue stay); with kDevNoStores the epilogue's stores too: what is left is this decomposition's floor.
constexpr int kDevNoMath = 1, kDevNoStores = 2, kDevTrace = 4;
constexpr int kTraceSlots = 16;
#endif

// One of mla_decode_kernel's builds (csrc/mla_decode_sm90.cu), as launch takes it.
using Kernel = void (*)(const Params);

// The production builds: for a bf16 (else fp16) q, the KV loads marked L2 evict-first, and over a cache of q's
// dtype, or (fp8) over an fp8 e4m3 one, whose one build per q dtype takes the L2 policy at run time
// (Params::evict_first; the evict_first argument is not read).
Kernel kernel_for(bool bf16, bool evict_first, bool fp8);
#ifdef EAGLE3_DEV_BUILD
// The development builds, bf16 only, for arguments the dev op checked: skeleton 1 | 3 (kDevNoMath, with
// kDevNoStores; evict-first loads), else skeleton 0: the kDevTrace build (traced) or the production one.
Kernel dev_kernel_for(bool evict_first, bool traced, int64_t skeleton);
#endif

// Whether the current device runs this build's real sm_90a kernel (asked once per device; no stream work).
bool sm90a_compiled(int device);

}  // namespace mla_sm90
}  // namespace eagle3
