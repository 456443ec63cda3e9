// A decode step through every decoder layer of a Llama in one call, float16 weights, float32
// arithmetic, activations and KV, on the CPU.
//
// In Python a layer of a decode step is about twenty operator calls (norms, the rotary
// embedding, views, the residual adds, SiLU) around its four matrix products; for a 135M model
// on one stream those calls cost about as much as reading the weights. Here a layer is four
// products through fbgemm's float16 GEMM (the kernel torch's quantized::linear_dynamic_fp16
// calls, on torch's intra-op threads), the attention of decode_attention.cpp, and plain loops
// for everything else.
//
//   x       [B, H]   float32, contiguous: the step's hidden states, updated in place
//   cos     [B, D]   float32: the rotary table of each sequence's position
//   sin     [B, D]   float32, its first half negated (x * cos + roll(x, D / 2) * sin rotates)
//   kv      B lists of one buffer a layer, [2, Hkv, capacity, D] float32 (the KV of a sequence)
//   starts  B positions (where each sequence's new position goes)

#include "cpu_decode.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

Fp16Linear::Fp16Linear(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat,
              "a weight must be a float32 [N, K] matrix");
  auto w = weight.contiguous();
  n_ = w.size(0);
  k_ = w.size(1);
  TORCH_CHECK(n_ > 0 && k_ > 0, "an empty weight");
  // the packed matrix is B = W^T [K, N], given transposed
  packed_ = std::make_unique<fbgemm::PackedGemmMatrixFP16>(
      fbgemm::matrix_op_t::Transpose, static_cast<int>(k_), static_cast<int>(n_), 1.0f,
      w.data_ptr<float>());
}

void Fp16Linear::into(const float* x, int64_t rows, float* out) const {
  const int tasks = at::get_num_threads();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, static_cast<int>(rows), x,
                                 *packed_, 0.0f, out, static_cast<int>(task), tasks);
  });
}

torch::Tensor Fp16Linear::forward(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == k_,
              "the input must be float32 [T, ", k_, "]");
  auto in = x.contiguous();
  auto out = torch::empty({in.size(0), n_}, in.options());
  if (in.size(0) > 0) into(in.data_ptr<float>(), in.size(0), out.data_ptr<float>());
  return out;
}

namespace {

// out[b] = x[b] / rms(x[b]) * w
void rms_norm(const float* x, const float* w, int64_t rows, int64_t h, float eps, float* out) {
  for (int64_t b = 0; b < rows; ++b) {
    const float* xr = x + b * h;
    float* o = out + b * h;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * r * w[i];
  }
}

// one head's rotary embedding: out = v * cos + roll(v, D / 2) * sin
void rotate(const float* v, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) out[i] = v[i] * cos[i] + v[(i + half) % d] * sin[i];
}

void check_f32(const torch::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.dim() == dims && t.scalar_type() == torch::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 tensor of ", dims, " dimensions");
}

}  // namespace

void decode_layers(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const std::vector<std::shared_ptr<DecodeLayer>>& layers,
                   const std::vector<std::vector<torch::Tensor>>& kv,
                   const std::vector<int64_t>& starts, int64_t heads, int64_t kv_heads,
                   double eps, double scale) {
  check_f32(x, 2, "x");
  check_f32(cos, 2, "cos");
  check_f32(sin, 2, "sin");
  const int64_t B = x.size(0), H = x.size(1), L = static_cast<int64_t>(layers.size());
  const int64_t D = cos.size(1);
  TORCH_CHECK(cos.size(0) == B && sin.size(0) == B && sin.size(1) == D && D % 2 == 0,
              "cos and sin must be [B, D] with D even");
  TORCH_CHECK(static_cast<int64_t>(kv.size()) == B && static_cast<int64_t>(starts.size()) == B,
              "one KV list and one position a sequence");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "bad head counts");
  const int64_t width = (heads + 2 * kv_heads) * D;
  for (const auto& layer : layers) {
    TORCH_CHECK(layer && layer->qkv && layer->o && layer->gate_up && layer->down,
                "a layer without its weights");
    TORCH_CHECK(layer->qkv->in_features() == H && layer->qkv->out_features() == width &&
                    layer->o->in_features() == heads * D && layer->o->out_features() == H &&
                    layer->gate_up->in_features() == H &&
                    layer->gate_up->out_features() % 2 == 0 &&
                    layer->down->in_features() == layer->gate_up->out_features() / 2 &&
                    layer->down->out_features() == H,
                "a layer's weights do not match the hidden size and heads");
    check_f32(layer->ln1, 1, "ln1");
    check_f32(layer->ln2, 1, "ln2");
    TORCH_CHECK(layer->ln1.size(0) == H && layer->ln2.size(0) == H, "a norm of the wrong size");
  }
  for (const auto& lists : kv)
    TORCH_CHECK(static_cast<int64_t>(lists.size()) == L, "one KV buffer a layer");
  if (B == 0 || L == 0) return;
  const int64_t inter = layers[0]->down->in_features();
  auto opts = x.options();
  auto h = torch::empty({B, H}, opts);
  auto qkv = torch::empty({B, width}, opts);
  auto q = torch::empty({B, heads, D}, opts);
  auto kv_new = torch::empty({B, 2, kv_heads, D}, opts);
  auto tmp = torch::empty({B, H}, opts);
  auto gu = torch::empty({B, 2 * inter}, opts);
  auto act = torch::empty({B, inter}, opts);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kvp = kv_new.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *ap = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  std::vector<torch::Tensor> bufs(B);
  for (int64_t l = 0; l < L; ++l) {
    const DecodeLayer& layer = *layers[l];
    rms_norm(xp, layer.ln1.data_ptr<float>(), B, H, e, hp);
    layer.qkv->into(hp, B, qkvp);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = qkvp + b * width;
      const float *c = cp + b * D, *s = sp + b * D;
      for (int64_t i = 0; i < heads; ++i) rotate(row + i * D, c, s, D, qp + (b * heads + i) * D);
      for (int64_t i = 0; i < kv_heads; ++i) {
        rotate(row + (heads + i) * D, c, s, D, kvp + ((b * 2) * kv_heads + i) * D);
        std::memcpy(kvp + ((b * 2 + 1) * kv_heads + i) * D, row + (heads + kv_heads + i) * D,
                    D * sizeof(float));
      }
      bufs[b] = kv[b][l];
    }
    auto a = decode_attention(q, kv_new, bufs, starts, scale);  // [B, heads * D]
    layer.o->into(a.data_ptr<float>(), B, tp);
    for (int64_t i = 0; i < B * H; ++i) xp[i] += tp[i];
    rms_norm(xp, layer.ln2.data_ptr<float>(), B, H, e, hp);
    layer.gate_up->into(hp, B, gup);
    for (int64_t b = 0; b < B; ++b) {
      const float *g = gup + b * 2 * inter, *u = g + inter;
      float* o = ap + b * inter;
      for (int64_t j = 0; j < inter; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
    layer.down->into(ap, B, tp);
    for (int64_t i = 0; i < B * H; ++i) xp[i] += tp[i];
  }
}
