// The op table: every torch.ops.eagle3 schema, in one place, grouped by area.
//
// Conventions (docs/design.md, "Schemas"):
//  - argument order and names are docs/design.md's; one name per argument everywhere;
//  - a mutated tensor carries a distinct alias name (a!), (b!), ... and a mutating op returns ();
//  - no streams or pointers: kernels run on the current stream of the inputs' device;
//  - values that change every step under CUDA-graph replay (seed, offset, temperature) are tensors.
//
// Implementations: CPU = the pure-PyTorch reference (eagle3_ops/reference.py, registered from
// Python), fakes in eagle3_ops/_register.py, CUDA kernels in csrc/<op>.cu (TORCH_LIBRARY_IMPL there).

#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#ifdef EAGLE3_WITH_CUDA
#include <torch/csrc/Exceptions.h>

#include "eagle3/errors.h"
#endif

TORCH_LIBRARY(eagle3, m) {
  // ---- capture --------------------------------------------------------------------------------
  // aux[r, slot*H:(slot+1)*H] = (hidden + residual)[rows[r]]
  m.def("capture_aux(Tensor hidden, Tensor? residual, Tensor(a!) aux, int slot, Tensor? rows) -> ()");
  // residual += x; x = rmsnorm(residual) * weight; aux[r, slot*H:(slot+1)*H] = residual[rows[r]]
  m.def(
      "add_rmsnorm_capture(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "Tensor(c!)? aux, int slot, Tensor? rows) -> ()");

  // ---- fc ---------------------------------------------------------------------------------------
  // out = norm(aux[rows]) @ (weight * weight_scale)^T; norm_mode: "none" | "norm_before_fc" | "fc_norm"
  m.def(
      "fc_proj(Tensor aux, Tensor weight, Tensor? weight_scale, Tensor? norm_weight, float eps, "
      "str norm_mode, Tensor? rows, Tensor(a!) out) -> ()");

  // ---- tree -------------------------------------------------------------------------------------
  // draft steps' top-k candidates -> canonical tree (tokens, parents), positions, tree_mask
  m.def(
      "build_tree(Tensor root_tokens, Tensor draft_tokens, Tensor draft_scores, Tensor draft_parents, "
      "Tensor prefix_lens, Tensor(a!) tokens, Tensor(b!) parents, Tensor(c!) positions, "
      "Tensor(d!) tree_mask) -> ()");

  // ---- attention --------------------------------------------------------------------------------
  // kv_scale: an fp8 e4m3 kv_cache's per-tensor dequantisation scale, [] or [1] fp32 on the device (vLLM's
  // layer._k_scale for MLA): key = fp8 * kv_scale; None for a bf16 / fp16 / fp32 cache. Last, and optional, so
  // that callers from before it keep working.
  m.def(
      "tree_attention_mla(Tensor q, Tensor kv_cache, Tensor page_table, Tensor prefix_lens, "
      "Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor? kv_scale=None) -> ()");
  // internal, Hopper only: tree_attention_mla's sm_90a kernel at 576 / 512 dims (csrc/mla_decode_sm90.cu; the op's
  // host side csrc/mla_decode_sm90_host.cu), called by its CUDA launcher, which checks the arguments and merges the
  // num_splits partials
  m.def(
      "_tree_attention_mla_sm90(Tensor q, Tensor kv_cache, Tensor page_table, Tensor prefix_lens, "
      "Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) part_out, "
      "Tensor(d!) part_lse, int num_splits, bool evict_first=False) -> ()");
#ifdef EAGLE3_DEV_BUILD
  // development builds only (setup.py EAGLE3_DEV_BUILD=1): the same kernel built with its per-block trace
  // (bench/dev/trace_mla.py) or as a no-math skeleton (skeleton 1 | 3; bench/dev/ceiling_mla.py)
  m.def(
      "_tree_attention_mla_sm90_dev(Tensor q, Tensor kv_cache, Tensor page_table, Tensor prefix_lens, "
      "Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) part_out, "
      "Tensor(d!) part_lse, int num_splits, bool evict_first, Tensor(e!)? trace, int skeleton) -> ()");
#endif
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor prefix_lens, "
      "Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse) -> ()");

  // ---- verify -----------------------------------------------------------------------------------
  m.def("verify_greedy(Tensor logits, Tensor tokens, Tensor parents) -> (Tensor accept_nodes, Tensor accept_len, Tensor emitted)");
  m.def(
      "verify_sampling(Tensor logits, Tensor? draft_probs, Tensor? d2t, Tensor tokens, Tensor parents, "
      "Tensor temperature, Tensor seed, Tensor offset) -> (Tensor accept_nodes, Tensor accept_len, Tensor emitted)");

  // ---- kv ---------------------------------------------------------------------------------------
  m.def(
      "kv_accept(Tensor(a!)[] caches, Tensor page_table, Tensor(b!) prefix_lens, Tensor accept_nodes, "
      "Tensor accept_len) -> ()");

  // ---- compat -----------------------------------------------------------------------------------
  // internal, CUDA only: eagle3_ops.compat.sglang's functions on CUDA tensors (csrc/compat_sglang_*.cu), with
  // sgl-kernel's argument names and order (its in-place outputs where it puts them) and every check the
  // Python path makes; the Python wrappers call these and keep their tensor-op path for CPU tensors
  m.def(
      "_sglang_build_tree(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
      "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
      "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()");
  m.def(
      "_sglang_verify_greedy(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
      "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
      "Tensor target_predict) -> ()");
  m.def(
      "_sglang_verify_sampling(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
      "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
      "Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, Tensor target_probs, "
      "Tensor(d!)? draft_probs, float threshold_single, float threshold_acc) -> ()");
  m.def(
      "_sglang_segment_packbits(Tensor x, Tensor input_indptr, Tensor output_indptr, Tensor(a!) y, "
      "int batch_size) -> ()");
  m.def(
      "_sglang_reconstruct_indices(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
      "Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, Tensor(d!) retrive_next_sibling, "
      "int batch_size, int draft_token_num) -> ()");
  // internal, CUDA only: eagle3_ops.compat.vllm's RejectionSampler step on vLLM's own tensors, read in place
  // (csrc/verify_greedy.cu, verify_sampling.cu): the ragged drafts through cu_num_draft_tokens, the logits rows
  // through target / bonus_logits_indices, the sampler's bonus tokens optional; returns sampled_token_ids
  // [batch_size, max_spec_len + 1] int32. CPU and fake implementations in eagle3_ops/compat/vllm.py.
  m.def(
      "_vllm_rejection_greedy(Tensor logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor target_logits_indices, Tensor bonus_logits_indices, Tensor? bonus_token_ids, int batch_size, "
      "int num_tokens, int max_spec_len) -> Tensor");
  m.def(
      "_vllm_rejection_sampling(Tensor logits, Tensor? draft_probs, Tensor draft_token_ids, "
      "Tensor cu_num_draft_tokens, Tensor target_logits_indices, Tensor bonus_logits_indices, "
      "Tensor? bonus_token_ids, Tensor temperature, Tensor seed, int batch_size, int num_tokens, "
      "int max_spec_len) -> Tensor");
}

// ---- build information, exposed through pybind11 as eagle3_ops._C.build_info() ---------------------
// The defines come from setup.py; the defaults say what a bare compile would mean.
#ifndef EAGLE3_CUDA_ARCHS
#define EAGLE3_CUDA_ARCHS ""
#endif
#ifndef EAGLE3_CUDA_VERSION
#define EAGLE3_CUDA_VERSION ""
#endif
#ifndef EAGLE3_TORCH_VERSION
#define EAGLE3_TORCH_VERSION ""
#endif
#ifndef EAGLE3_CUDA_KERNELS
#define EAGLE3_CUDA_KERNELS ""
#endif

#ifdef EAGLE3_WITH_CUDA
namespace {
// Strict mode's raiser (eagle3/errors.h): eagle3_ops.errors._raise_recorded(device) reads and clears the word
// and raises Eagle3InputError; the Python exception travels through the dispatcher as torch's python_error,
// which torch.ops restores as the Python exception it was.
void raise_recorded(int device) {
  pybind11::gil_scoped_acquire gil;
  try {
    pybind11::module_::import("eagle3_ops.errors").attr("_raise_recorded")(device);
  } catch (pybind11::error_already_set& e) {
    e.restore();
    python_error err;
    err.persist();
    throw err;
  }
}
}  // namespace
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "eagle3_ops native extension: the op table (torch.ops.eagle3) and the CUDA kernels";
  m.def("build_info", []() {
    pybind11::dict info;
#ifdef EAGLE3_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_archs"] = std::string(EAGLE3_CUDA_ARCHS);
    info["cuda_version"] = std::string(EAGLE3_CUDA_VERSION);
    info["torch_version"] = std::string(EAGLE3_TORCH_VERSION);
    info["cuda_kernels"] = std::string(EAGLE3_CUDA_KERNELS);
#ifdef EAGLE3_NO_DEVICE_CHECKS
    info["device_checks"] = false;
#else
    info["device_checks"] = true;
#endif
#ifdef EAGLE3_DEV_BUILD
    info["dev_build"] = true;
#else
    info["dev_build"] = false;
#endif
    return info;
  }, "What this build of _C holds: CUDA kernels compiled or not, for which archs, against which CUDA and torch.");
#ifdef EAGLE3_WITH_CUDA
  m.def("_error_word", [](int device) {
    return torch::from_blob(eagle3::device_error_word(device), {eagle3::kErrorWords},
                            torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA, device));
  }, "The device error word of cuda:device as an int64 tensor over its static memory (eagle3/errors.h).");
  m.def("_error_word_devices", &eagle3::error_word_devices, "Devices whose error word has been taken so far.");
  m.def("_set_strict", &eagle3::set_strict_mode, "Strict mode on or off (eagle3_ops.set_strict).");
  m.def("_strict", &eagle3::strict_mode, "Whether strict mode is on.");
  eagle3::set_strict_raiser(&raise_recorded);
#endif
}
