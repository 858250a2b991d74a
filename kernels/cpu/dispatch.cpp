// The native CPU kernels' entry points.
//
// The dispatcher's CPU kernels of hybrid::prefill, hybrid::decode and hybrid::attn (TORCH_LIBRARY_IMPL) take
// precedence over the ops' Python implementation (hybrid_ops/ops.py, CompositeExplicitAutograd) for CPU tensors.
// A call that the native kernel serves ("cpu", or "auto" while "auto" picks it) runs here without entering Python:
// the checks of validation.check_args, the routing of modes.ROUTING, the kernel; a few microseconds per call, eager or
// from a compiled graph. Any other call (another backend, an argument that fails a check, a mode or backend name
// not in the tables) goes to the Python implementation, which runs the other backends and raises the errors that
// name the argument. Every option of the ops runs here: sinks, chunked attention, a value head dim other than q's,
// fp8 caches with their k_scale, v_scale, a speculative tree's tree_mask (its values checked with the metadata's).
// Python sets the tables (`configure`, hybrid_ops/backends/cpu.py) on every change to the backend registry; until it
// does, every call goes to Python.
//
// The Python module's `forward` is the backend object's call of the same kernel, and its `causal_conv1d`,
// `gated_delta_rule` and `selective_scan` the backend's state ops (state_ops.h): those go through Python
// (hybrid_ops/state_ops.py checks their arguments and routes them).

// Not torch/extension.h: the whole C++ frontend it brings would double the build time.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "options.h"  // generated from hybrid_ops/options.py when the kernels build: HYBRID_OPTIONS(X)
#include "paged_attention.h"
#include "schedule.h"
#include "state_ops.h"

// The ops' options, expanded from the table: as parameters (in schema order, each after a comma), as the fields of
// `Options` (references to the call's arguments), as the values that initialise it, as keyword arguments to Python
// and as pybind's names.
#define OPTION_PARAMETER(type, name) , type name
#define OPTION_FIELD(type, name) type name;
#define OPTION_VALUE(type, name) name,
#define OPTION_KEYWORD(type, name) , py::arg(#name) = name
#define OPTION_NAME(type, name) , py::arg(#name)

namespace {

struct Options {
  HYBRID_OPTIONS(OPTION_FIELD)
};

struct Tables {
  std::vector<std::tuple<int64_t, std::string, bool>> routes;  // (forward_mode, speculative mode, decode path?)
  std::vector<std::string> native;                             // backend names that mean this kernel
  std::vector<std::string> known;                              // every valid backend name, "auto" included

  // 1 for the decode path, 0 for prefill, -1 when the pair is not in the table.
  int route(int64_t forward_mode, c10::string_view speculative_attention_mode) const {
    for (const auto& [mode, spec, decode] : routes) {
      if (mode == forward_mode && spec == speculative_attention_mode) return decode ? 1 : 0;
    }
    return -1;
  }
  static bool has(const std::vector<std::string>& names, c10::string_view name) {
    for (const auto& n : names) {
      if (n == name) return true;
    }
    return false;
  }
};

// Replaced whole by `configure` (with the GIL held), read by the kernels with an atomic load and no lock.
std::shared_ptr<const Tables> tables;

std::shared_ptr<const Tables> current_tables() { return std::atomic_load(&tables); }

bool is_fp8(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2; }

// The helpers of hybrid_ops/check_rows.py, the rows of checks.h call them.
constexpr double inf = std::numeric_limits<double>::infinity();
bool same_device(const at::Tensor& t, const at::Tensor& q) { return t.device() == q.device(); }
bool same_dtype(const at::Tensor& t, const at::Tensor& other) { return t.scalar_type() == other.scalar_type(); }
bool is_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}
bool is_float32(const at::Tensor& t) { return t.scalar_type() == at::kFloat; }
bool is_bool(const at::Tensor& t) { return t.scalar_type() == at::kBool; }
bool is_fp8(const at::Tensor& t) { return is_fp8(t.scalar_type()); }
bool is_int32(const at::Tensor& t) { return t.scalar_type() == at::kInt; }
template <typename T>
bool given(const std::optional<T>& option) {
  return option.has_value();
}
bool value_rows_ok(const at::Tensor& v_cache) {
  if (v_cache.is_contiguous()) return true;
  const int64_t row = v_cache.stride(2);
  return v_cache.stride(3) == 1 && row > v_cache.size(3) && v_cache.stride(1) == v_cache.size(2) * row &&
         v_cache.stride(0) == v_cache.size(1) * v_cache.size(2) * row;
}

}  // namespace

// Generated from hybrid_ops/validation.py and options.py when the kernels build: tensors_ok, options_ok,
// decode_shape_ok.
#include "checks.h"

namespace {

// validation.check_args: true when it would pass, for tensors on the CPU (the only ones the native kernels take).
bool args_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
             const at::Tensor& block_table, const Options& o) {
  return q.device().is_cpu() && tensors_ok(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table) &&
         options_ok(q, k_cache, o);
}

// The kernel's output, or an undefined tensor (nothing written) when the metadata's values are invalid; options
// checked by the caller.
at::Tensor attend(bool decode, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                  const at::Tensor& block_table, const Options& o) {
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  return hybrid_ops::paged_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale,
                                     o.sliding_window, o.logit_cap, o.sinks, o.attention_chunk, decode, o.k_scale,
                                     o.v_scale, o.tree_mask);
}

// The kernel's output, or an undefined tensor (nothing written) when a check fails.
at::Tensor run_native(bool decode, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                      const at::Tensor& block_table, const Options& o) {
  if (!args_ok(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, o)) return {};
  if (decode && !decode_shape_ok(q.size(0), seq_lens.size(0))) return {};
  return attend(decode, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, o);
}

// call(ops.PYTHON_IMPLEMENTATIONS), with the GIL: the kernels run without it, and building the arguments' Python
// objects needs it too.
template <typename F>
at::Tensor call_python(F&& call) {
  py::gil_scoped_acquire gil;
  // Looked up once and kept for the process: destroying it after the interpreter's exit would crash.
  static py::object* impls = new py::object(py::module_::import("hybrid_ops.ops").attr("PYTHON_IMPLEMENTATIONS"));
  return call(*impls).template cast<at::Tensor>();
}

template <bool Decode>
at::Tensor path_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                    const at::Tensor& block_table HYBRID_OPTIONS(OPTION_PARAMETER), c10::string_view backend) {
  const Options options{HYBRID_OPTIONS(OPTION_VALUE)};
  const auto t = current_tables();
  if (t && Tables::has(t->native, backend)) {
    auto out = run_native(Decode, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options);
    if (out.defined()) return out;
  }
  return call_python([&](const py::object& impls) {
    return impls[Decode ? "decode" : "prefill"](q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                                block_table HYBRID_OPTIONS(OPTION_KEYWORD),
                                                py::arg("backend") = std::string(backend));
  });
}

at::Tensor attn_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                    const at::Tensor& block_table, int64_t forward_mode HYBRID_OPTIONS(OPTION_PARAMETER),
                    c10::string_view prefill_backend, c10::string_view decode_backend,
                    c10::string_view speculative_attention_mode) {
  const Options options{HYBRID_OPTIONS(OPTION_VALUE)};
  if (const auto t = current_tables()) {
    const int route = t->route(forward_mode, speculative_attention_mode);
    const bool decode = route == 1;
    if (route >= 0 && Tables::has(t->native, decode ? decode_backend : prefill_backend) &&
        Tables::has(t->known, decode ? prefill_backend : decode_backend)) {
      auto out = run_native(decode, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options);
      if (out.defined()) return out;
    }
  }
  return call_python([&](const py::object& impls) {
    return impls["attn"](q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                         forward_mode HYBRID_OPTIONS(OPTION_KEYWORD),
                         py::arg("prefill_backend") = std::string(prefill_backend),
                         py::arg("decode_backend") = std::string(decode_backend),
                         py::arg("speculative_attention_mode") = std::string(speculative_attention_mode));
  });
}

// The backend object's call (hybrid_ops/backends/cpu.py), its arguments checked by the ops.
at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                   const at::Tensor& block_table HYBRID_OPTIONS(OPTION_PARAMETER), bool decode) {
  const Options options{HYBRID_OPTIONS(OPTION_VALUE)};
  return attend(decode, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options);
}

// The checks, for tests that hold them to validation.py's on the same inputs.
bool args_ok_py(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                const at::Tensor& block_table HYBRID_OPTIONS(OPTION_PARAMETER)) {
  return args_ok(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, Options{HYBRID_OPTIONS(OPTION_VALUE)});
}

void configure(std::vector<std::tuple<int64_t, std::string, bool>> routes, std::vector<std::string> native,
               std::vector<std::string> known) {
  std::atomic_store(&tables,
                    std::shared_ptr<const Tables>(new Tables{std::move(routes), std::move(native), std::move(known)}));
}

}  // namespace

TORCH_LIBRARY_IMPL(hybrid, CPU, m) {
  m.impl("prefill", &path_cpu<false>);
  m.impl("decode", &path_cpu<true>);
  m.impl("attn", &attn_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "KV store, then paged attention; None when the metadata's values are invalid",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cu_seqlens_q"),
        py::arg("seq_lens"), py::arg("block_table") HYBRID_OPTIONS(OPTION_NAME), py::arg("decode"));
  m.def("args_ok", &args_ok_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("block_table") HYBRID_OPTIONS(OPTION_NAME));
  m.def("decode_shape_ok", &decode_shape_ok);
  m.def("metadata_values_ok", &hybrid_ops::metadata_values_ok, py::arg("cu_seqlens_q"), py::arg("seq_lens"),
        py::arg("block_table"), py::arg("num_tokens"), py::arg("num_pages"), py::arg("page_size"), py::arg("decode"),
        py::arg("tree_mask") = py::none());
  // The work schedule and the sizes it cuts by, for tests of its properties.
  m.def("schedule", &hybrid_ops::work_schedule,
        "(units, merges, pack_jobs): int64 rows of (request, head, num_heads, t0, num_tokens, lo, hi, partial, "
        "packed, packed_from), (request, head, num_tokens, num_splits, partial, split_stride), (request, head, j0, n)",
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("num_kv_heads"), py::arg("group"), py::arg("head_dim"),
        py::arg("v_head_dim"), py::arg("sliding_window") = -1, py::arg("attention_chunk") = -1,
        py::arg("gemm_rows") = hybrid_ops::cpu::GEMM_ROWS);
  m.attr("KV_SPLIT") = hybrid_ops::cpu::KV_SPLIT;
  m.attr("KV_SPLIT_ALL_HEADS") = hybrid_ops::cpu::KV_SPLIT_ALL_HEADS;
  m.attr("BLOCK_ROWS") = hybrid_ops::cpu::BLOCK_ROWS;
  m.attr("GEMM_ROWS") = hybrid_ops::cpu::GEMM_ROWS;
  m.attr("GEMM_ROWS_AMX") = hybrid_ops::cpu::GEMM_ROWS_AMX;
  m.attr("GEMM_BLOCK_N") = hybrid_ops::cpu::GEMM_BLOCK_N;
  m.def("widen_fp8", &hybrid_ops::widen_fp8,
        "fp8 codes [n] (n a multiple of 64) as raw float32 values, by the wide load or 16 at a time", py::arg("codes"),
        py::arg("wide"));
  m.attr("FP8_WIDE_VECS") = hybrid_ops::fp8_wide_vecs();
  m.attr("BF16_PAIRS") = hybrid_ops::bf16_pairs();
  m.def("multiplies_in_cache_dtype", &hybrid_ops::multiplies_in_cache_dtype,
        "Whether many query rows over a 16-bit cache multiply in 16 bits (AMX) rather than fp32");
  hybrid_ops::define_state_ops(m);
  m.def("configure", &configure,
        "The routing table as (forward_mode, speculative_attention_mode, decode path?), the backend names that "
        "mean the native kernel, and every valid backend name");
}
