// Hopper (sm_90a) warpgroup MMA, shared-memory descriptors, cp.async, 16-byte shared loads / stores and named
// barriers, as inline PTX: the pieces of csrc/mla_decode_sm90.cu's kernel (no CUTLASS: the build vendors no
// third-party sources).
//
// Shared-memory tiles are [rows x 64] 16-bit elements, 128 bytes a row, in the 128-byte swizzle: the
// 16-byte chunk c of row r lives at r * 128 + ((c ^ (r % 8)) * 16), so 8 rows form one 1024-byte atom
// (tiles start 1024-byte aligned). A wide matrix is a row of such tiles ("column chunks", 64 columns
// each, one after the other). Descriptors (PTX ISA "Matrix Descriptor Format"; CUTLASS's canonical
// GMMA layouts in units of 16 bytes):
//  - K-major (the reduction dim contiguous: Q and K for Q K^T, P for P V): SW128 ((8,n),2):((8,SBO),1),
//    SBO = 1024 (the next 8 rows); a k16 step inside a chunk adds 32 bytes to the start address.
//  - MN-major (V for P V: the output dim contiguous, imm-trans-b = 1): SW128 ((8,n),(8,k)):((1,LBO),(8,SBO)),
//    LBO = the next 64 columns (the next column chunk), SBO = 1024 (the next 8 rows of the reduction).
#pragma once

#include <cstdint>

namespace eagle3 {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// byte offset of 16-byte chunk c of row r inside a 128-byte-swizzled [rows x 64] tile
__device__ __forceinline__ uint32_t swizzle128(uint32_t r, uint32_t c) { return r * 128u + ((c ^ (r & 7u)) << 4); }

__device__ __forceinline__ uint64_t desc_field(uint32_t bytes) { return static_cast<uint64_t>((bytes & 0x3FFFFu) >> 4); }

// SW128 descriptor at smem byte address addr with the given leading / stride byte offsets
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return desc_field(addr) | (desc_field(lbo) << 16) | (desc_field(sbo) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins accumulator registers in place: the wait asm does not name them, so without this nvcc may move a
// read of an in-flight accumulator above the wait (ptxas then serialises every wgmma, C7514).
template <int kN>
__device__ __forceinline__ void fence_operand(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// generic-proxy writes to shared memory (cp.async, st.shared) made visible to wgmma's async proxy
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// all but the kPending most recent groups complete
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 16 bytes global -> shared with an L2 cache policy (createpolicy): the KV rows are read once
__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, uint32_t src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}

// 16 bytes shared -> registers, and registers -> shared (addr: a 16-byte aligned shared-memory byte address)
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

// ---- wgmma.mma_async, f32 accumulators, one function per shape and input type (f16 / bf16), stamped out by
// the macros below (generated: one asm operand per accumulator register) ----------------------------------
// Accumulator layout (m64nN, per warpgroup thread t = 32 w + l): d[4 j + 0, 1] is row 16 w + l / 4,
// columns 8 j + 2 (l % 4) + {0, 1}; d[4 j + 2, 3] the same columns of row 16 w + l / 4 + 8.
// A and B from shared memory (descriptors): wgmma_m64n{64,256}k16_<ty><kTransB>; kTransB = 1: B is N-major;
// scale_d = 0 overwrites D.

#define EAGLE3_WGMMA_SS_N64(TY)                                                                                        \
template <int kTransB>                                                                                                 \
__device__ __forceinline__ void wgmma_m64n64k16_##TY(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {  \
  asm volatile(                                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY " {"                                                   \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                         \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"                                                \
      "}, %32, %33, p, 1, 1, 0, %35;\n}\n"                                                                             \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),          \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),        \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])         \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));                                                         \
}

#define EAGLE3_WGMMA_SS_N256(TY)                                                                                         \
template <int kTransB>                                                                                                   \
__device__ __forceinline__ void wgmma_m64n256k16_##TY(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {  \
  asm volatile(                                                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                      \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." #TY "." #TY " {"                                                    \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                           \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                                 \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                                                 \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"                                                 \
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                                                 \
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                                                 \
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"                                     \
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"                                  \
      "}, %128, %129, p, 1, 1, 0, %131;\n}\n"                                                                            \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),            \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),          \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),          \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),          \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),          \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),          \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),          \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),          \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),          \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),          \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),          \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),      \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])   \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));                                                           \
}

EAGLE3_WGMMA_SS_N64(f16)
EAGLE3_WGMMA_SS_N64(bf16)
EAGLE3_WGMMA_SS_N256(f16)
EAGLE3_WGMMA_SS_N256(bf16)

#undef EAGLE3_WGMMA_SS_N64
#undef EAGLE3_WGMMA_SS_N256


}  // namespace sm90
}  // namespace eagle3
