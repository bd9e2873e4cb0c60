// eagle3_ops.compat.sglang's build_tree_kernel_efficient on CUDA tensors as one op,
// torch.ops.eagle3._sglang_build_tree: one block per request (one warp when N <= 32 and depth * M <= 256). What the
// compat ops share (the algorithms' source, the checks, no host sync) is said in eagle3/compat_sglang.h.

#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "eagle3/compat_sglang.cuh"

namespace eagle3 {
namespace {

// ---- device helpers ------------------------------------------------------------------------------------------

// An int32 | int64 index as loaded, widened where it is used (get), not right after its load, where it would wait for
// the load before the kernel's next reads are issued (is64 a compile-time constant: the build kernels').
struct Lazy {
  int64_t w = 0;
  int32_t n = 0;
  __device__ __forceinline__ int64_t get() const { return w + n; }
};
__device__ __forceinline__ Lazy load_lazy(const void* __restrict__ p, bool is64, int64_t i) {
  Lazy r;
  if (is64) {
    r.w = __ldg(static_cast<const int64_t*>(p) + i);
  } else {
    r.n = __ldg(static_cast<const int32_t*>(p) + i);
  }
  return r;
}

// ==== build_tree_kernel_efficient =============================================================================

constexpr int kBuildMaxThreads = 512;
constexpr int64_t kBuildMaxSlots = 8192;  // depth * M candidate slots held in shared memory
constexpr int64_t kBuildMaxNodes = 1024;

// SGLang's flat candidate g (a parent_list entry) -> its slot within draft depth d - 1 of our [depth, M] layout
// (wrapping as the Triton kernel's int64 arithmetic does: a value that far out is out of range either way).
__device__ __forceinline__ int64_t parent_local(int64_t g, int topk, int M, int d) {
  const uint64_t slot = g < topk ? static_cast<uint64_t>(g) : static_cast<uint64_t>(g) + static_cast<uint64_t>(M - topk);
  return static_cast<int64_t>(slot - static_cast<uint64_t>(d - 1) * static_cast<uint64_t>(M));
}

// FULL_MASK: the earlier requests' prefix lengths, sum(seq_lens[:b]), in two parts so that their round trip
// overlaps the kernel's other reads (in one piece, its loop's adds waited for its loads before the selection's and
// the parents' reads were issued: two round trips in the sm_90a SASS at 4b20943). seq_before_issue loads this
// thread's entries tid + u T, u < kSeqAhead (issued with the other reads; nothing waits on them yet);
// seq_before_sum, called once every other read is issued, adds them and the entries past the first kSeqAhead * T
// (four loads in flight at a time). The build kernels take seq_lens' dtype as a template argument: chosen at run
// time, the two dtypes' values merged right after their loads, and the merge waited for them.
constexpr int kSeqAhead = 4;
struct SeqAhead {
  Lazy v[kSeqAhead];
};
__device__ __forceinline__ void seq_before_issue(const void* __restrict__ seq_lens, bool seq64, int64_t b, int tid,
                                                 int T, SeqAhead& a) {
#pragma unroll
  for (int u = 0; u < kSeqAhead; ++u) {
    const int64_t k = tid + static_cast<int64_t>(u) * T;
    if (k < b) a.v[u] = load_lazy(seq_lens, seq64, k);
  }
}
__device__ __forceinline__ int64_t seq_before_sum(const void* __restrict__ seq_lens, bool seq64, int64_t b, int tid,
                                                  int T, const SeqAhead& v) {
  int64_t s = 0;
#pragma unroll
  for (int u = 0; u < kSeqAhead; ++u) s += v.v[u].get();
#pragma unroll 1
  for (int64_t k = tid + static_cast<int64_t>(kSeqAhead) * T; k < b; k += 4 * static_cast<int64_t>(T)) {
    int64_t w[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) w[u] = k + u * T < b ? sglang::load_index(seq_lens, seq64, k + u * T) : 0;
    s += (w[0] + w[1]) + (w[2] + w[3]);
  }
  return s;
}

// parent_list [B, P] int64 (P = topk * (depth - 1) + 1, or 0 at depth 1); selected [B, N - 1] int64;
// seq_lens [B] int32 | int64; mask: the output mask's bytes (mask_numel); positions [B * N] int64;
// r_index / r_next / r_sib [B, N] int64; err: the device error word.
// Slot c = d * M + m is our [depth, M] layout of SGLang's flat candidates (f < topk: row 0, then topk^2 per
// depth; M = topk^2, or topk at depth 1). grid: B blocks of blockDim.x (whole warps, <= kBuildMaxThreads);
// dynamic shared memory: a region of max(CS * 10, N * W * 4) bytes (the slots' parent slot and node, int32,
// and chosen / fin flags, u8; once the parents are known, each node's ancestor bits, W = ceil(N / 32) words),
// then N parents (int32).
//
// One small block per request, so its critical path is the time: every global load is issued before the
// first barrier, six barriers in all (the rank scan and the prefix lengths' sum share one), and no thread scans
// the nodes one by one: the first child and the next sibling come from warp ballots over the parents (32 a
// step), the mask rows from each node's ancestor bits (one walk up per node and word), a warp per row writing
// its bytes. Trees of N <= 32 nodes and at most 256 slots take sglang_build_small_kernel (one warp, no barrier).
template <bool kSeq64>  // seq_lens int64 (else int32)
__global__ void __launch_bounds__(kBuildMaxThreads) sglang_build_kernel(
    const int64_t* __restrict__ parent_list, int64_t P, const int64_t* __restrict__ selected,
    const void* __restrict__ seq_lens, uint8_t* __restrict__ mask, int64_t mask_numel,
    int64_t* __restrict__ positions, int64_t* __restrict__ r_index, int64_t* __restrict__ r_next,
    int64_t* __restrict__ r_sib, int topk, int depth, int M, int N, int mode, int nb, size_t region,
    int64_t* __restrict__ err) {
  extern __shared__ int32_t smem32[];
  __shared__ int warp_count[kBuildMaxThreads / 32];
  __shared__ int64_t warp_seq[kBuildMaxThreads / 32];
  __shared__ int first_bad;
  const int CS = depth * M, W = (N + 31) / 32;
  int32_t* ps = smem32;                                   // [CS] parent slot: -1 from the root, -2 out of range
  int32_t* node = ps + CS;                                // [CS] node of the slot, or -1
  uint8_t* chosen = reinterpret_cast<uint8_t*>(node + CS);  // [CS] selected
  uint8_t* fin = chosen + CS;                             // [CS] selected, and so is every ancestor
  uint32_t* anc = reinterpret_cast<uint32_t*>(smem32);    // [N, W] after the slots: ancestor-or-self bits
  int32_t* par = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(smem32) + region);  // [N] parent node
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = T >> 5;
  const int64_t C = topk + static_cast<int64_t>(depth - 1) * topk * topk;  // SGLang's candidates
  // each thread takes a contiguous run of slots (the rank scan below counts them in order)
  const int per = (CS + T - 1) / T;
  const int lo = min(CS, tid * per), hi = min(CS, lo + per);

  // every global read first: the prefix lengths, the first selected entries, each slot's parent_list entry
  if (tid == 0) first_bad = INT_MAX;
  constexpr bool seq64 = kSeq64;
  const Lazy seq_at = load_lazy(seq_lens, seq64, b);  // seq_lens[b], widened where it is used
  SeqAhead seq_v;  // FULL_MASK: the prefix lengths before b (summed below)
  if (mode == 0) seq_before_issue(seq_lens, seq64, b, tid, T, seq_v);
  const int64_t sel0 = tid < N - 1 ? selected[b * (N - 1) + tid] : -1;
  for (int c = lo; c < hi; ++c) {
    const int d = c / M, m = c - d * M;
    int32_t p = -1;
    if (d > 0) {
      const int64_t local = parent_local(parent_list[b * P + 1 + (d - 1) * topk + m / topk], topk, M, d);
      p = local >= 0 && local < M ? (d - 1) * M + static_cast<int32_t>(local) : -2;
    }
    ps[c] = p;
    chosen[c] = 0;
  }
  __syncthreads();
  // the selected slots (a selected candidate outside [0, C) is skipped; duplicates select once)
  auto choose = [&](int64_t s) {
    if (s >= 0 && s < C) chosen[s < topk ? s : s + (M - topk)] = 1;
  };
  choose(sel0);
  for (int j = tid + T; j < N - 1; j += T) choose(selected[b * (N - 1) + j]);
  __syncthreads();
  // a selected slot whose parent_list entry is outside depth d - 1 is build_tree's draft_parents error (it hangs
  // from the root); fin: selected with every ancestor selected (the chain ends at the root or at such an entry)
  int count = 0;
  for (int c = lo; c < hi; ++c) {
    const bool ch = chosen[c] != 0;
    if (EAGLE3_UNLIKELY(ch && ps[c] == -2)) atomicMin(&first_bad, c);
    bool f = ch;
    for (int x = ps[c], steps = 0; f && x >= 0 && steps < depth; x = ps[x], ++steps) f = chosen[x] != 0;
    fin[c] = f;
    count += f;
  }
  // build_tree's ranks: the fin slots in slot order (their -index scores), then the others in slot order;
  // one barrier for the scan of the fin counts and the sum of the prefix lengths
  const int inclusive = sglang::warp_inclusive_sum(count);
  int64_t seq_sum = mode == 0 ? seq_before_sum(seq_lens, seq64, b, tid, T, seq_v) : 0;
  for (int o = 16; o > 0; o >>= 1) seq_sum += __shfl_down_sync(0xffffffffu, seq_sum, o);
  if (lane == 31) warp_count[warp] = inclusive;
  if (lane == 0) warp_seq[warp] = seq_sum;
  __syncthreads();
  int before = inclusive - count, total = 0;
  int64_t seq_before = 0;
  for (int k = 0; k < nw; ++k) {
    total += warp_count[k];
    before += k < warp ? warp_count[k] : 0;
    seq_before += warp_seq[k];
  }
  if (tid == 0 && EAGLE3_UNLIKELY(first_bad != INT_MAX)) {  // the first bad slot, as the Triton kernel reports it
    const int c = first_bad, d = c / M, m = c - d * M;
    const int64_t local = parent_local(parent_list[b * P + 1 + (d - 1) * topk + m / topk], topk, M, d);
    report_range(err, kOpBuildTree, kArgDraftParents, local, 0, M - 1, b, d, m);
  }
  // ranks 0 .. N - 2 become nodes 1 .. N - 1
  for (int c = lo; c < hi; ++c) {
    const int rank = fin[c] ? before : total + (c - before);
    before += fin[c];
    node[c] = rank < N - 1 ? rank + 1 : -1;
  }
  __syncthreads();
  // a node's parent is the node of its parent slot (an unselected slot's: slot 0 of depth d - 1, as the Triton
  // kernel reads it; from the root: 0). A slot ranks after its parent slot (fin ones first, each group in slot
  // order, a parent slot < its child's), so that is a node with a smaller index
  if (tid == 0) par[0] = -1;
  for (int c = lo; c < hi; ++c) {
    const int n = node[c];
    if (n < 1) continue;
    const int d = c / M;
    const int p = chosen[c] ? (ps[c] >= 0 ? ps[c] : -1) : (d > 0 ? (d - 1) * M : -1);
    const int pn = p < 0 ? 0 : node[p];
    par[n] = pn >= 0 && pn < n ? pn : 0;
  }
  __syncthreads();  // the slots are read for the last time above: their region holds the ancestor bits next

  const int64_t seq = seq_at.get();
  // per (node i, word w): the word's ancestor-or-self bits and the depth -> positions, retrive_index; the packed
  // mask (N <= 32: one word)
  for (int t = tid; t < N * W; t += T) {
    const int i = t / W, w = t - i * W;
    uint32_t bits = 0;
    int dep = -1;
    for (int x = i, steps = 0; x >= 0 && steps <= N; x = par[x], ++steps) {
      if ((x >> 5) == w) bits |= 1u << (x & 31);
      ++dep;
    }
    anc[t] = bits;
    if (w == 0) {
      positions[b * N + i] = seq + dep;
      r_index[b * N + i] = b * N + i;
    }
    if (mode == 2) {  // QLEN_ONLY_BITPACKING: nb little-endian bytes per row; byte 0 set, the others OR-ed into
      uint8_t* row = mask + (b * N + i) * nb;
      row[0] = static_cast<uint8_t>(bits & 255u);
      for (int k = 1; k < nb; ++k) row[k] |= static_cast<uint8_t>((bits >> (8 * k)) & 255u);
    }
  }
  __syncthreads();
  // a warp per node i: over each word of columns j, first child = the first j whose parent is i, next sibling
  // = the first j > i with i's parent (written where they exist); FULL_MASK / QLEN_ONLY: row i's bools, j an
  // ancestor of i or i itself. Row (b, i) of the FULL_MASK block starts at N*N*b + N*sum(seq[:b]) +
  // (seq[b] + N)*i + seq[b] (entries past the buffer skipped)
  const int64_t start = mode == 0 ? static_cast<int64_t>(N) * N * b + N * seq_before + seq
                                  : static_cast<int64_t>(N) * N * b;
  const int64_t stride = mode == 0 ? seq + N : N;
  for (int i = warp; i < N; i += nw) {
    const int pi = par[i];
    int first = -1, sib = -1;
    for (int w = 0; w < W; ++w) {
      const int j = 32 * w + lane;
      const int pj = j < N ? par[j] : -2;
      const unsigned child = __ballot_sync(0xffffffffu, pj == i);
      const unsigned next = __ballot_sync(0xffffffffu, pi >= 0 && pj == pi && j > i);
      if (first < 0 && child != 0u) first = 32 * w + __ffs(child) - 1;
      if (sib < 0 && next != 0u) sib = 32 * w + __ffs(next) - 1;
      if (mode != 2 && j < N) {
        const int64_t at = start + stride * i + j;
        if (at >= 0 && at < mask_numel) mask[at] = (anc[i * W + w] >> lane) & 1u;
      }
    }
    if (lane == 0) {
      if (first >= 0) r_next[b * N + i] = first;
      if (sib >= 0) r_sib[b * N + i] = sib;
    }
  }
}

// ---- small trees: one warp a request -------------------------------------------------------------------------

constexpr int kSmallMaxNodes = 32;   // a node a lane: one mask word
constexpr int kSmallMaxRounds = 8;   // slots a lane: depth * M <= 256

// floor(x / y) for 0 <= x < 2^16 and 1 <= y < 2^16, given inv = 1.0f / y: x + 1/2 and inv are exact / correctly
// rounded, so the product is within 2^-23 relative of (x + 1/2) / y, which is at least 1 / (2y) from an integer.
__device__ __forceinline__ int small_div(int x, float inv) {
  return static_cast<int>((static_cast<float>(x) + 0.5f) * inv);
}

// sglang_build_kernel's outputs for a tree of N <= 32 nodes and depth * M <= 32 * R slots, one warp per request
// (its arguments, and inv_m / inv_topk = 1.0f / M, 1.0f / topk; grid: B blocks of 32 threads, static shared memory
// only). Slot c = 32 r + lane is lane's r-th (so the ranks come from ballots: no scan), node i is lane i. The same
// ranks, parents and outputs as sglang_build_kernel, bit for bit, on every input (the bad values' too: what it
// skips, what it reports); what differs is the critical path of a request:
//   - every global read is issued first (the prefix lengths four at a time, parent_list once per slot, the packed
//     mask bytes that are OR-ed into), then only shared memory, shuffles and ballots: no block barrier, five
//     __syncwarp() where lanes read what others wrote (the zeroed selection words, the selection, the walks'
//     links, the slots' nodes, the nodes' parents);
//   - the fin walks of a lane's R slots advance together, a step of each a round (one shared load);
//   - a node's ancestor bits by pointer jumping (about log2 of the tree's depth rounds of two shuffles), its
//     depth = their count - 1; first child and next sibling from one __match_any_sync over the parents (no scan
//     over nodes);
//   - the bool mask rows written 32 / 2^ceil(log2 N) rows a pass (a byte store per lane), the packed row as one
//     store of its nb bytes when the buffer is nb-aligned (bytes otherwise).
template <int R, bool kSeq64>
__global__ void __launch_bounds__(32) sglang_build_small_kernel(
    const int64_t* __restrict__ parent_list, int64_t P, const int64_t* __restrict__ selected,
    const void* __restrict__ seq_lens, uint8_t* __restrict__ mask, int64_t mask_numel,
    int64_t* __restrict__ positions, int64_t* __restrict__ r_index, int64_t* __restrict__ r_next,
    int64_t* __restrict__ r_sib, int topk, int depth, int M, int N, int mode, int nb, float inv_m, float inv_topk,
    int64_t* __restrict__ err) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ int32_t ps_s[32 * R];     // a selected slot's parent slot (-1 the root, -2 out of range), else -3
  __shared__ int32_t node_s[32 * R];   // node of the slot, or -1
  __shared__ uint32_t chosen_s[R];     // selected slots: bit c & 31 of word c >> 5
  __shared__ int32_t par_s[kSmallMaxNodes];
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x, CS = depth * M;
  const unsigned below = (1u << lane) - 1u, above = ~below & ~(1u << lane);
  const int64_t C = topk + static_cast<int64_t>(depth - 1) * topk * topk;  // SGLang's candidates

  // every global read first: the prefix lengths, the selection (one entry a lane), each slot's parent_list
  // entry ((c - M) / topk = (d - 1) * topk + m / topk, M = topk^2), the packed row's bytes 1 .. nb - 1
  constexpr bool seq64 = kSeq64;
  const Lazy seq_at = load_lazy(seq_lens, seq64, b);  // seq_lens[b], widened where it is used
  SeqAhead seq_v;  // FULL_MASK: the prefix lengths before b (summed below)
  if (mode == 0) seq_before_issue(seq_lens, seq64, b, lane, 32, seq_v);
  const int64_t sel = lane < N - 1 ? selected[b * (N - 1) + lane] : -1;
  int64_t g[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane;
    g[r] = c >= M && c < CS ? parent_list[b * P + 1 + small_div(c - M, inv_topk)] : 0;
  }
  uint8_t* row = mask + (b * N + lane) * nb;
  const bool wide = mode == 2 && (reinterpret_cast<uintptr_t>(mask) & static_cast<uintptr_t>(nb - 1)) == 0;
  uint32_t old = 0;  // (nb 1 is always wide)
  if (mode == 2 && nb > 1 && lane < N) {
    if (wide) {
      old = nb == 2 ? *reinterpret_cast<const uint16_t*>(row) : *reinterpret_cast<const uint32_t*>(row);
    } else {
      old = static_cast<uint32_t>(row[1]) << 8;
      if (nb == 4) old |= static_cast<uint32_t>(row[2]) << 16 | static_cast<uint32_t>(row[3]) << 24;
    }
  }

  // parent slots; the selected slots (a selected candidate outside [0, C) is skipped; duplicates select once)
  if (lane < R) chosen_s[lane] = 0u;
  int d[R], ps[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane;
    d[r] = small_div(c, inv_m);
    int p = -1;
    if (c >= M && c < CS) {
      const int64_t local = parent_local(g[r], topk, M, d[r]);
      p = local >= 0 && local < M ? (d[r] - 1) * M + static_cast<int>(local) : -2;
    }
    ps[r] = p;
  }
  __syncwarp();
  if (sel >= 0 && sel < C) {
    const int c = static_cast<int>(sel < topk ? sel : sel + (M - topk));
    atomicOr(&chosen_s[c >> 5], 1u << (c & 31));
  }
  __syncwarp();
  // fin: selected with every ancestor selected (the chain ends at the root or at an out-of-range entry). Each
  // slot's link becomes its parent slot if it is selected, else kUnchosen: a step of a walk is one shared load
  constexpr int kUnchosen = -3;
  bool ch[R], fin[R];
  int up[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ch[r] = (chosen_s[r] >> lane) & 1u;
    fin[r] = ch[r];
    up[r] = ps[r];
    ps_s[32 * r + lane] = ch[r] ? ps[r] : kUnchosen;
  }
  __syncwarp();
  for (int steps = 0; steps < depth; ++steps) {
    bool more = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool on = fin[r] && up[r] >= 0;
      const int link = ps_s[on ? up[r] : 0];  // (unconditional: the R loads of a step go out back to back)
      fin[r] = on ? link != kUnchosen : fin[r];
      up[r] = on ? link : up[r];
      more = more || on;
    }
    if (!__any_sync(kAll, more)) break;
  }
  // build_tree's ranks: the fin slots in slot order, then the others in slot order; ranks 0 .. N - 2 become
  // nodes 1 .. N - 1 (a slot past CS is not fin and ranks at c >= CS >= N - 1)
  unsigned fins[R];
  int total = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    fins[r] = __ballot_sync(kAll, fin[r]);
    total += __popc(fins[r]);
  }
  int before = 0, node[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane, mine = before + __popc(fins[r] & below);
    const int rank = fin[r] ? mine : total + (c - mine);
    before += __popc(fins[r]);
    node[r] = rank < N - 1 ? rank + 1 : -1;
    node_s[c] = node[r];
  }
  if (lane == 0) par_s[0] = -1;
  __syncwarp();
  // a node's parent: the node of its parent slot (an unselected slot's: slot 0 of depth d - 1; from the root: 0)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = node[r];
    const int p = ch[r] ? (ps[r] >= 0 ? ps[r] : -1) : (d[r] > 0 ? (d[r] - 1) * M : -1);
    const int pn_read = node_s[p < 0 ? 0 : p];  // (read for every slot: no branch before the load)
    const int pn = p < 0 ? 0 : pn_read;
    if (n >= 1) par_s[n] = pn >= 0 && pn < n ? pn : 0;
  }
  __syncwarp();

  const int64_t seq = seq_at.get();
  // lane i = node i: ancestor-or-self bits (par[j] < j, so the chain ends at the root within N - 1 hops)
  const int pa = lane < N ? par_s[lane] : -2;
  uint32_t anc = lane < N ? 1u << lane : 0u;
  int hop = pa;  // after k rounds: anc holds the node and its 2^k - 1 nearest ancestors, hop the next one
  for (int span = 1; span < N; span <<= 1) {
    if (!__any_sync(kAll, hop >= 0)) break;
    const int src = hop >= 0 ? hop : 0;
    const uint32_t a = __shfl_sync(kAll, anc, src);
    const int h = __shfl_sync(kAll, hop, src);
    if (hop >= 0) {
      anc |= a;
      hop = h;
    }
  }
  // first child = the first node of each group of equal parents, next sibling = the next node of the group
  const unsigned same = __match_any_sync(kAll, pa);  // lanes >= N (-2) form a group of their own
  if (lane < N) {
    positions[b * N + lane] = seq + (__popc(anc) - 1);
    r_index[b * N + lane] = b * N + lane;
    if (pa >= 0) {
      if ((same & below) == 0u) r_next[b * N + pa] = lane;
      if ((same & above) != 0u) r_sib[b * N + lane] = __ffs(same & above) - 1;
    }
    if (mode == 2) {  // QLEN_ONLY_BITPACKING: byte 0 set, bytes 1 .. nb - 1 OR-ed into (N <= 8 nb: anc fits)
      const uint32_t v = anc | (old & ~255u);
      if (nb == 1) {
        row[0] = static_cast<uint8_t>(v);
      } else if (wide) {
        if (nb == 2) {
          *reinterpret_cast<uint16_t*>(row) = static_cast<uint16_t>(v);
        } else {
          *reinterpret_cast<uint32_t*>(row) = v;
        }
      } else {
        row[0] = static_cast<uint8_t>(v);
        row[1] = static_cast<uint8_t>(v >> 8);
        if (nb == 4) {
          row[2] = static_cast<uint8_t>(v >> 16);
          row[3] = static_cast<uint8_t>(v >> 24);
        }
      }
    }
  }
  if (mode != 2) {  // FULL_MASK / QLEN_ONLY: bool (i, j) = j an ancestor of i or i itself
    int64_t seq_before = mode == 0 ? seq_before_sum(seq_lens, seq64, b, lane, 32, seq_v) : 0;
    for (int o = 16; o > 0; o >>= 1) seq_before += __shfl_xor_sync(kAll, seq_before, o);
    const int64_t start = mode == 0 ? static_cast<int64_t>(N) * N * b + N * seq_before + seq
                                    : static_cast<int64_t>(N) * N * b;
    const int64_t stride = mode == 0 ? seq + N : N;
    // 32 / 2^ceil(log2 N) rows a pass, lane = (row, column j)
    const int log_np = 32 - __clz(N - 1), rows = 32 >> log_np, j = lane & ((1 << log_np) - 1);
    for (int i0 = 0; i0 < N; i0 += rows) {
      const int i = i0 + (lane >> log_np);
      const uint32_t a = __shfl_sync(kAll, anc, i & 31);
      const int64_t at = start + stride * i + j;
      if (j < N && i < N && at >= 0 && at < mask_numel) mask[at] = (a >> j) & 1u;
    }
  }
  // the first selected slot whose parent_list entry is outside depth d - 1, reported as sglang_build_kernel does
  int first_bad = -1;
#pragma unroll
  for (int r = R - 1; r >= 0; --r) {
    const unsigned bad = __ballot_sync(kAll, ch[r] && ps[r] == -2);
    if (bad != 0u) first_bad = 32 * r + __ffs(bad) - 1;
  }
  if (lane == 0 && EAGLE3_UNLIKELY(first_bad >= 0)) {
    const int c = first_bad, dd = c / M, m = c - dd * M;
    const int64_t local = parent_local(parent_list[b * P + 1 + (dd - 1) * topk + m / topk], topk, M, dd);
    report_range(err, kOpBuildTree, kArgDraftParents, local, 0, M - 1, b, dd, m);
  }
}

void sglang_build_tree_cuda(const at::Tensor& parent_list, const at::Tensor& selected_index,
                            const at::Tensor& verified_seq_len, const at::Tensor& tree_mask, const at::Tensor& positions,
                            const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                            const at::Tensor& retrive_next_sibling, int64_t topk, int64_t depth,
                            int64_t draft_token_num, int64_t tree_mask_mode) {
  const int nb = sglang::check_build(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                                     retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num,
                                     tree_mask_mode);
  const int64_t B = parent_list.size(0), P = parent_list.size(1), N = draft_token_num, mode = tree_mask_mode;
  if (B == 0) return;
  const int64_t M = depth > 1 ? topk * topk : topk;
  TORCH_CHECK_NOT_IMPLEMENTED(depth * M <= kBuildMaxSlots && N <= kBuildMaxNodes && B < (int64_t{1} << 31),
                              "compat_sglang build: more than ", kBuildMaxSlots, " candidate slots or ", kBuildMaxNodes,
                              " nodes per request, or B >= 2**31");
  const c10::cuda::OptionalCUDAGuard guard(parent_list.device());
  const cudaStream_t stream = sglang::current_stream(parent_list);
  const int device = parent_list.get_device();
  const int64_t CS = depth * M, W = (N + 31) / 32;
  if (N <= kSmallMaxNodes && CS <= 32 * kSmallMaxRounds) {  // one warp a request
    const bool s64 = verified_seq_len.scalar_type() == at::kLong;
    auto pick = [&](auto r) {
      constexpr int R = decltype(r)::value;
      return s64 ? sglang_build_small_kernel<R, true> : sglang_build_small_kernel<R, false>;
    };
    auto kernel = CS <= 32 ? pick(std::integral_constant<int, 1>{})
                           : (CS <= 64 ? pick(std::integral_constant<int, 2>{})
                                       : (CS <= 128 ? pick(std::integral_constant<int, 4>{})
                                                    : pick(std::integral_constant<int, 8>{})));
    kernel<<<static_cast<unsigned>(B), 32, 0, stream>>>(
        P ? parent_list.data_ptr<int64_t>() : nullptr, P, selected_index.data_ptr<int64_t>(),
        verified_seq_len.data_ptr(),
        static_cast<uint8_t*>(tree_mask.data_ptr()), tree_mask.numel() * static_cast<int64_t>(tree_mask.element_size()),
        positions.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
        retrive_next_sibling.data_ptr<int64_t>(), static_cast<int>(topk), static_cast<int>(depth), static_cast<int>(M),
        static_cast<int>(N), static_cast<int>(mode), nb, 1.0f / static_cast<float>(M),
        1.0f / static_cast<float>(topk), device_error_word(device));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    after_launch(device, stream);
    return;
  }
  const auto kernel =
      verified_seq_len.scalar_type() == at::kLong ? sglang_build_kernel<true> : sglang_build_kernel<false>;
  const size_t region = static_cast<size_t>(std::max(CS * 10, N * W * 4) + 3) / 4 * 4;
  const size_t smem = region + static_cast<size_t>(N) * sizeof(int32_t);  // at most 132 KiB
  if (smem > 48 * 1024) {
    int max_smem = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TORCH_CHECK_NOT_IMPLEMENTED(smem <= static_cast<size_t>(max_smem), "compat_sglang build: ", smem,
                                " bytes of shared memory a request, this GPU has ", max_smem);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  // a thread per slot, per (node, mask word), or four nodes a warp (the row pass), in whole warps, 32 .. 512
  const int64_t work = std::max({CS, N * W, 32 * ((N + 3) / 4)});
  const int threads = static_cast<int>(std::clamp<int64_t>((work + 31) / 32 * 32, 32, kBuildMaxThreads));
  kernel<<<static_cast<unsigned>(B), threads, smem, stream>>>(
      P ? parent_list.data_ptr<int64_t>() : nullptr, P, selected_index.data_ptr<int64_t>(),
      verified_seq_len.data_ptr(),
      static_cast<uint8_t*>(tree_mask.data_ptr()), tree_mask.numel() * static_cast<int64_t>(tree_mask.element_size()),
      positions.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
      retrive_next_sibling.data_ptr<int64_t>(), static_cast<int>(topk), static_cast<int>(depth), static_cast<int>(M),
      static_cast<int>(N), static_cast<int>(mode), nb, region, device_error_word(device));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(device, stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("_sglang_build_tree", &eagle3::sglang_build_tree_cuda); }
