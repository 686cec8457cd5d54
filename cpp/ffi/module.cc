// The nanobind extension: hands the FFI handlers to Python as capsules, once, at import.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "brgemm/brgemm.h"
#include "brgemm/peak.h"
#include "ffi/ffi_common.h"
#include "layers/common/emulation.h"
#include "layers/lstm/lstm.h"
#include "parallel/job.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Every handler defined with XLA_FFI_DEFINE_HANDLER_SYMBOL in cpp/ffi/*.cc.
// One layer's targets per line.
#define JB_FFI_TARGETS(X)                                  \
  X(jb_brgemm) X(jb_brgemm_acc)                            \
  X(jb_peak_probe)                                         \
  X(jb_fc_fwd) X(jb_fc_act_grad) X(jb_fc_bwd) X(jb_fc_upd) X(jb_fc_upd_sgd) X(jb_fc_upd_adamw) \
  X(jb_lstm_fwd) X(jb_lstm_bptt) X(jb_lstm_tangent)        \
  X(jb_conv_fwd) X(jb_conv_bwd) X(jb_conv_upd)             \
  X(jb_attention_fwd) X(jb_attention_bwd) X(jb_attention_jvp) \
  X(jb_beyond_bf16) X(jb_bernoulli)                        \
  /* a new layer's line goes above */

#define JB_DECLARE(name) extern "C" XLA_FFI_Error* name(XLA_FFI_CallFrame*);
JB_FFI_TARGETS(JB_DECLARE)
#undef JB_DECLARE

NB_MODULE(_jax_brgemm, m) {
  m.def("registrations", [] {
    nb::dict targets;
#define JB_REGISTER(name) targets[#name] = nb::capsule(reinterpret_cast<void*>(&name));
    JB_FFI_TARGETS(JB_REGISTER)
#undef JB_REGISTER
    return targets;
  });
  m.def("lstm_saved_width", [](int64_t t, int64_t n, int64_t c, int64_t k, bool bf16, bool time_major,
                               int64_t products) {
    return jb::lstm::saved_width({t, n, c, k, bf16 ? jb::DType::bf16 : jb::DType::f32, time_major, products},
                                 jb::dispatch());
  }, nb::arg("t"), nb::arg("n"), nb::arg("c"), nb::arg("k"), nb::arg("bf16"), nb::arg("time_major"),
     nb::arg("products") = 0,
     "Columns of jb_lstm_fwd's saved xh for a shape, compute dtype (float32 or bfloat16) and "
     "emulated product count.");
  m.def("lstm_saved_gates_shape", [](int64_t t, int64_t n, int64_t k, bool bf16, int64_t products) {
    const auto d = jb::lstm::saved_gate_dims(
        {t, n, 0, k, bf16 ? jb::DType::bf16 : jb::DType::f32, false, products}, jb::dispatch());
    return nb::make_tuple(d[0], d[1], d[2], d[3]);
  }, nb::arg("t"), nb::arg("n"), nb::arg("k"), nb::arg("bf16"), nb::arg("products") = 0,
     "Shape of jb_lstm_fwd's saved gates: (T, K-blocks, N, 4 x block).");
  m.def("lstm_da_width", [](int64_t t, int64_t n, int64_t k, bool bf16, bool time_major) {
    return jb::lstm::da_width({t, n, 0, k, bf16 ? jb::DType::bf16 : jb::DType::f32, time_major});
  }, "Columns of jb_lstm_bptt's da (4K, padded) for a shape and compute dtype.");
  m.def("isa", [] { return jb::isa_name(jb::best_isa()); },
        "The kernel ISA in use: amx, avx512, avx2 or generic (JAX_BRGEMM_ISA lowers it).");
  m.def("bf16_multiply", [] { return jb::dispatch().bf16_multiply == jb::DType::bf16 ? "bfloat16" : "float32"; },
        "The dtype the kernels multiply bfloat16 operands in (JAX_BRGEMM_BF16 forces it).");
  m.def("isa_names", [] {
    nb::list names;
    for (jb::Isa isa : {jb::Isa::amx, jb::Isa::avx512, jb::Isa::avx2, jb::Isa::generic})
      names.append(jb::isa_name(isa));
    return names;
  }, "The ISA names JAX_BRGEMM_ISA accepts, best first.");
  m.def("activations", [] {
    nb::dict codes;
    for (const auto& a : jb::kActivationNames) codes[a.name] = static_cast<int>(a.act);
    return codes;
  }, "The fused activations: name -> the code the FFI handlers take as `act`.");
  m.def("set_async", [](bool on) { jb::ffi_util::async_enabled().store(on); },
        "Whether the handlers may return before their work is done (the same bits either way).");
  m.def("async_enabled", [] { return jb::ffi_util::async_enabled().load(); });
  m.def("timeline", [](bool on) { jb::timeline_enable(on); },
        "Record every worker's stretch in a layer call (for profiles; see timeline_take).");
  m.def("timeline_take", [] {
    nb::list out;
    for (const jb::Span& s : jb::timeline_take())
      out.append(nb::make_tuple(s.tid, s.t0, s.t1, s.real0, s.reblock_ns, std::string(s.name), s.async, s.caller));
    return out;
  }, "The recorded spans (tid, start ns, end ns, start ns of CLOCK_REALTIME, ns re-blocking, job, async,\n"
        "caller), cleared.");
  m.def("peak_flops_per_iter", [](const std::string& unit) {
    if (unit == "fma") return jb::peak_flops_per_iter(jb::DType::f32);
    if (unit == "vdpbf16ps") return jb::peak_flops_per_iter(jb::DType::bf16);
    if (unit == "amx") return jb::peak_amx_flops_per_iter();
    throw std::invalid_argument("peak unit must be fma, vdpbf16ps or amx, got " + unit);
  }, "Floating-point operations per iteration of one jb_peak_probe work item.");
  m.def("split_block", [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig> src, nb::ndarray<uint8_t, nb::c_contig> out,
                          int64_t products, bool trans, int64_t repeats, int64_t block_rows, int64_t block_cols) {
    // src (rows x cols, or cols x rows when trans) split `repeats` times into its packed bf16
    // (VNNI) parts for `products` products, or with products = 0 copied, into out: for
    // bench/bench_split.py to time (nothing here reads a clock: test_dispatch.py). With a
    // block size, block by block into the same block_rows x block_cols buffer, as a pass
    // splits a large weight's panel blocks.
    const int64_t rows = int64_t(src.shape(trans ? 1 : 0)), cols = int64_t(src.shape(trans ? 0 : 1));
    const int64_t br = block_rows > 0 ? std::min(block_rows, rows) : rows, bc = block_cols > 0 ? std::min(block_cols, cols) : cols;
    const int64_t pr = (br + 1) / 2 * 2, n = rows * cols, ld = trans ? rows : cols;
    const jb::emulation::Terms t = jb::emulation::terms(products ? products : 1);
    const bool blocked = br < rows || bc < cols;
    const size_t need = products ? size_t(t.parts[1] * pr * bc) * 2 : size_t(blocked ? br * bc : n) * 4;
    if (out.size() < need) throw std::invalid_argument("split_block: out holds fewer than " + std::to_string(need) + " bytes");
    const float* s = src.data();
    nb::gil_scoped_release release;
    // The copy of a block: its source row pieces one after the other into the buffer.
    auto copy_block = [&](const float* b, int64_t r0, int64_t c0) {
      const int64_t lines = trans ? std::min(bc, cols - c0) : std::min(br, rows - r0);
      const int64_t len = trans ? std::min(br, rows - r0) : std::min(bc, cols - c0);
      for (int64_t i = 0; i < lines; ++i) std::memcpy(out.data() + i * len * 4, b + i * ld, size_t(len) * 4);
    };
    for (int64_t r = 0; r < repeats; ++r) {
      if (!products && !blocked) std::memcpy(out.data(), s, size_t(n) * sizeof(float));
      else
        for (int64_t c0 = 0; c0 < cols; c0 += bc)
          for (int64_t r0 = 0; r0 < rows; r0 += br)
            if (!products) copy_block(s + (trans ? c0 * ld + r0 : r0 * ld + c0), r0, c0);
            else jb::emulation::pack(t, 1, s + (trans ? c0 * ld + r0 : r0 * ld + c0), jb::DType::f32, ld, trans,
                                std::min(br, rows - r0), std::min(bc, cols - c0), br, bc, jb::DType::bf16, true,
                                out.data(), pr * bc, jb::best_isa(), nullptr);
    }
  }, nb::arg("src"), nb::arg("out"), nb::arg("products"), nb::arg("trans"), nb::arg("repeats"),
     nb::arg("block_rows") = 0, nb::arg("block_cols") = 0,
     "Splits src (float32, C order; transposed: its columns are the block's rows) into its packed bf16\n"
     "parts for `products` products, or with products = 0 memcpys it, into out, `repeats` times; with\n"
     "block_rows / block_cols, block by block into one block's buffer (the copy: each block's row pieces).");
}
