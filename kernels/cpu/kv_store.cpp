// The KV store: each new token's k and v rows into the cache rows of its position, in q's dtype or quantized to fp8 as
// hybrid_ops.fp8.quantize stores them (fp8.h).

#include <ATen/Parallel.h>

#include "kernel.h"

namespace hybrid_ops::cpu {
namespace {

template <typename T, typename C>
void store_rows(const KvRows<T, C>& kv, const Metadata& md, const std::vector<int64_t>& request_of, int64_t page_size,
                int64_t heads) {
  const int64_t num_tokens = md.cu[md.num_requests], dim = kv.dim, head_stride = kv.head_stride;
  const int64_t st = kv.src_strides[0], sh = kv.src_strides[1], sd = kv.src_strides[2];
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(is_fp8<C> ? dim : 0);  // a row in fp32, for quantize_row
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = request_of[t];
      const int64_t pos = md.lens[i] - (md.cu[i + 1] - md.cu[i]) + t - md.cu[i];
      const int64_t page = md.table[i * md.table_stride + pos / page_size];
      C* dst = kv.cache + (page * page_size + pos % page_size) * heads * head_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = kv.src + t * st + h * sh;
        if constexpr (is_fp8<C>) {
          for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(x[d * sd]);
          quantize_row(row.data(), kv.kv_scale[h], dst + h * head_stride, dim);
        } else if (sd == 1) {
          std::copy_n(x, dim, dst + h * head_stride);
        } else {
          for (int64_t d = 0; d < dim; ++d) dst[h * head_stride + d] = x[d * sd];
        }
      }
    }
  });
}

}  // namespace

template <typename T, typename C>
void store_kv(const KvRows<T, C>& k, const KvRows<T, C>& v, const Metadata& md, int64_t page_size,
              int64_t num_kv_heads) {
  std::vector<int64_t> request_of(md.cu[md.num_requests]);
  for (int64_t i = 0; i < md.num_requests; ++i) {
    std::fill(request_of.begin() + md.cu[i], request_of.begin() + md.cu[i + 1], i);
  }
  store_rows(k, md, request_of, page_size, num_kv_heads);
  store_rows(v, md, request_of, page_size, num_kv_heads);
}

#define INSTANTIATE(T, C) \
  template void store_kv(const KvRows<T, C>&, const KvRows<T, C>&, const Metadata&, int64_t, int64_t);
HYBRID_OPS_CPU_TYPES(INSTANTIATE)

}  // namespace hybrid_ops::cpu
