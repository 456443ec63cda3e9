// One decode step's attention for B sequences of one new position each, on the CPU, float32.
//
// Each sequence keeps its keys and values in a buffer of its own, [2, Hkv, capacity, D]
// (gateway.engine.local.batch.SeqKV). For every sequence this writes its new key/value rows at
// its position, then attends its query heads, grouped under their key/value head, over the
// buffer's positions [0, position]: each key and value row is read once for all G query heads
// that share it. One call a layer replaces a write, a few views and a flash-attention call per
// sequence; (sequence, key/value head) pairs are spread over torch's intra-op threads.
//
//   q       [B, Hq, D]       float32, contiguous
//   kv_new  [B, 2, Hkv, D]   float32, contiguous
//   bufs    B tensors [2, Hkv, cap_b, D] float32, contiguous
//   starts  B positions (where each sequence's new position goes, < cap_b)
// returns   [B, Hq * D]

#include "cpu_decode.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kv_new,
                               const std::vector<torch::Tensor>& bufs,
                               const std::vector<int64_t>& starts, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [B, Hq, D]");
  TORCH_CHECK(kv_new.dim() == 4 && kv_new.scalar_type() == torch::kFloat &&
                  kv_new.is_contiguous(),
              "kv_new must be a contiguous float32 [B, 2, Hkv, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv_new.size(2);
  TORCH_CHECK(kv_new.size(0) == B && kv_new.size(1) == 2 && kv_new.size(3) == D,
              "kv_new does not match q");
  TORCH_CHECK(static_cast<int64_t>(bufs.size()) == B && static_cast<int64_t>(starts.size()) == B,
              "one buffer and one position a sequence");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must group under key/value heads");
  const int64_t G = Hq / Hkv;
  std::vector<float*> base(B);
  std::vector<int64_t> caps(B);
  const float* kvn = kv_new.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const auto& buf = bufs[b];
    TORCH_CHECK(buf.dim() == 4 && buf.scalar_type() == torch::kFloat && buf.is_contiguous() &&
                    buf.size(0) == 2 && buf.size(1) == Hkv && buf.size(3) == D,
                "a buffer must be a contiguous float32 [2, Hkv, capacity, D]");
    caps[b] = buf.size(2);
    TORCH_CHECK(starts[b] >= 0 && starts[b] < caps[b], "a position beyond its buffer");
    base[b] = buf.data_ptr<float>();
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(base[b] + ((kv * Hkv + h) * caps[b] + starts[b]) * D,
                    kvn + ((b * 2 + kv) * Hkv + h) * D, D * sizeof(float));
  }
  auto out = torch::empty({B, Hq * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;  // [G, L] scores, then weights
    std::vector<float> m(G), inv(G);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv, L = starts[b] + 1, cap = caps[b];
      const float* K = base[b] + h * cap * D;
      const float* V = base[b] + (Hkv + h) * cap * D;
      const float* qg = qp + (b * Hq + h * G) * D;  // the G query heads of this kv head
      float* og = op + b * Hq * D + h * G * D;
      w.resize(G * L);
      for (int64_t g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < L; ++t) {
        const float* k = K + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qg + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qh[d] * k[d];
          acc *= sc;
          w[g * L + t] = acc;
          m[g] = acc > m[g] ? acc : m[g];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        float* wg = w.data() + g * L;
        const float mg = m[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          wg[t] = std::exp(wg[t] - mg);
          sum += wg[t];
        }
        inv[g] = 1.f / sum;
      }
      std::memset(og, 0, G * D * sizeof(float));
      for (int64_t t = 0; t < L; ++t) {
        const float* v = V + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = w[g * L + t] * inv[g];
          float* o = og + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}
