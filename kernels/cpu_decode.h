// The CPU decode kernels (kernels/cpu_decode.py builds them into one extension).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <vector>

#include <fbgemm/FbgemmFP16.h>

// decode_attention.cpp: one decode step's attention over per-sequence KV buffers.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kv_new,
                               const std::vector<torch::Tensor>& bufs,
                               const std::vector<int64_t>& starts, double scale);

// decode_layers.cpp: a matrix rounded to float16 once, in the layout fbgemm's kernel reads;
// products in float32 arithmetic on torch's intra-op threads.
class Fp16Linear {
 public:
  explicit Fp16Linear(const torch::Tensor& weight);  // [N, K] float32
  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_; }
  void into(const float* x, int64_t rows, float* out) const;  // x [rows, K] -> out [rows, N]
  torch::Tensor forward(const torch::Tensor& x) const;        // [T, K] float32 -> [T, N]

 private:
  int64_t n_, k_;
  std::unique_ptr<fbgemm::PackedGemmMatrixFP16> packed_;
};

// One Llama decoder layer's weights as the decode step reads them.
struct DecodeLayer {
  torch::Tensor ln1, ln2;  // RMSNorm weights [H] float32
  std::shared_ptr<Fp16Linear> qkv, o, gate_up, down;
};

void decode_layers(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const std::vector<std::shared_ptr<DecodeLayer>>& layers,
                   const std::vector<std::vector<torch::Tensor>>& kv, const std::vector<int64_t>& starts,
                   int64_t heads, int64_t kv_heads, double eps, double scale);
