// AdamW on fp32 master weights of 16-bit (bf16 / fp16) parameters, in one pass per element: read the
// 16-bit gradient, update the fp32 master, exp_avg, exp_avg_sq (and max_exp_avg_sq), write the weight
// rounded to 16 bits (round to nearest even). Built and loaded by cpu_adamw.py (g++, ctypes); no torch
// headers, so it compiles in about a second.
//
// The arithmetic is torch's CPU fused AdamW kernel's, operation for operation, so that the fp32 results
// are bitwise torch._fused_adamw_'s on the fp32 master with the gradient cast to fp32
// (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, adam_math for float, ADAM_MODE::ADAMW). That kernel
// runs two code paths whose roundings differ (its compiler contracts multiply-adds differently):
// - the vector body (all but the last numel % width elements of each tensor):
//     v = fma(c2 * g, g, v * beta2);  p = p * decay + (-step_size * m) / denom
// - the scalar tail (the last numel % width elements):
//     v = fma(v, beta2, (c2 * g) * g); p = fma(p, decay, -((step_size * m) / denom))
// and in both: m = fma(w', g - m, base) (exp_avg.lerp_(grad, 1 - beta1) with torch's lerp: w' = w,
// base = m when |w| < 0.5, else w' = w - 1, base = g), denom = sqrt(v or max(v_max, v)) / bc2_sqrt + eps.
// Which width and which forms hold for the installed torch is not assumed: cpu_adamw.py checks this
// library bitwise against torch._fused_adamw_ before using it, and falls back when they differ.
// This file is compiled with -ffp-contract=off so that the forms are exactly the ones written here.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Hyper {
  float decay;       // 1 - lr * weight_decay (1 when weight_decay == 0: p * 1 is p)
  float lerp_w;      // (float)(1 - beta1)
  float beta2;       // (float)beta2
  float c2;          // (float)(1 - beta2)
  float eps;         // (float)eps
  float grad_scale;  // 1 when there is none (g / 1 is g)
  float sign;        // -1 to maximize (g * -1, as torch's kernel negates)
};

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// round to nearest even, NaN to the canonical quiet NaN (c10::BFloat16's round_to_nearest_even)
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

struct BF16 {
  using storage = uint16_t;
  static float load(storage x) { return bf16_to_float(x); }
  static storage round(float f) { return float_to_bf16(f); }
};

struct FP16 {  // IEEE half: the compiler's conversions (F16C on x86), round to nearest even
  using storage = _Float16;
  static float load(storage x) { return static_cast<float>(x); }
  static storage round(float f) { return static_cast<_Float16>(f); }
};

// elements [begin, end) of one tensor; TAIL selects the scalar tail's forms (see the header)
template <typename W, bool AMSGRAD, bool TAIL>
void update(float* __restrict p, float* __restrict m, float* __restrict v, float* __restrict vmax,
            const typename W::storage* __restrict g, typename W::storage* __restrict w, int64_t begin,
            int64_t end, const Hyper h, float step_size, float bc2_sqrt) {
  const bool small = std::fabs(h.lerp_w) < 0.5f;
  const float lerp_coeff = small ? h.lerp_w : h.lerp_w - 1.0f;
  const float neg_step_size = -step_size;
  for (int64_t i = begin; i < end; ++i) {
    float gi = W::load(g[i]) / h.grad_scale * h.sign;
    float mi = m[i];
    mi = std::fma(lerp_coeff, gi - mi, small ? mi : gi);
    float vi = TAIL ? std::fma(v[i], h.beta2, (h.c2 * gi) * gi) : std::fma(h.c2 * gi, gi, v[i] * h.beta2);
    float second = vi;
    if (AMSGRAD) {
      second = std::max(vmax[i], vi);
      vmax[i] = second;
    }
    float denom = std::sqrt(second) / bc2_sqrt + h.eps;
    float pi = p[i] * h.decay + (neg_step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    w[i] = W::round(pi);
  }
}

template <typename W, bool AMSGRAD>
void update_range(float* p, float* m, float* v, float* vmax, const void* g, void* w, int64_t begin, int64_t end,
                  int64_t body_end, const Hyper& h, float step_size, float bc2_sqrt) {
  auto gs = static_cast<const typename W::storage*>(g);
  auto ws = static_cast<typename W::storage*>(w);
  int64_t split = std::min(std::max(begin, body_end), end);
  update<W, AMSGRAD, false>(p, m, v, vmax, gs, ws, begin, split, h, step_size, bc2_sqrt);
  update<W, AMSGRAD, true>(p, m, v, vmax, gs, ws, split, end, h, step_size, bc2_sqrt);
}

}  // namespace

extern "C" {

// One AdamW step of `count` tensors. Per tensor t: master[t], exp_avg[t], exp_avg_sq[t] (and, with
// amsgrad, max_exp_avg_sq[t]) are fp32 arrays of numel[t] elements, updated in place; grad[t] is read
// and weight[t] written, 16-bit (is_bf16[t]: bf16, else fp16). step_size[t] = lr / (1 - beta1^step) and
// bc2_sqrt[t] = sqrt(1 - beta2^step) are the host's doubles rounded to float, as torch's kernel rounds
// them. `width`: torch's vector width (the scalar tail is each tensor's last numel % width elements).
// The work is cut into blocks of `block` elements shared among `threads` OpenMP threads.
void grpo_master_adamw_step(int64_t count, float* const* master, float* const* exp_avg, float* const* exp_avg_sq,
                            float* const* max_exp_avg_sq, const void* const* grad, void* const* weight,
                            const int64_t* numel, const int8_t* is_bf16, const float* step_size,
                            const float* bc2_sqrt, float decay, float lerp_w, float beta2, float c2, float eps,
                            float grad_scale, float sign, int amsgrad, int64_t width, int64_t block, int threads) {
  const Hyper h{decay, lerp_w, beta2, c2, eps, grad_scale, sign};
  std::vector<int64_t> first(count + 1, 0);  // first[t]: the first block of tensor t
  for (int64_t t = 0; t < count; ++t) first[t + 1] = first[t] + (numel[t] + block - 1) / block;
  const int64_t blocks = first[count];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    const int64_t n = numel[t];
    const int64_t begin = (b - first[t]) * block;
    const int64_t end = std::min(begin + block, n);
    const int64_t body_end = n - n % width;
    float* vmax = amsgrad ? max_exp_avg_sq[t] : nullptr;
    if (is_bf16[t]) {
      if (amsgrad)
        update_range<BF16, true>(master[t], exp_avg[t], exp_avg_sq[t], vmax, grad[t], weight[t], begin, end, body_end, h, step_size[t], bc2_sqrt[t]);
      else
        update_range<BF16, false>(master[t], exp_avg[t], exp_avg_sq[t], vmax, grad[t], weight[t], begin, end, body_end, h, step_size[t], bc2_sqrt[t]);
    } else {
      if (amsgrad)
        update_range<FP16, true>(master[t], exp_avg[t], exp_avg_sq[t], vmax, grad[t], weight[t], begin, end, body_end, h, step_size[t], bc2_sqrt[t]);
      else
        update_range<FP16, false>(master[t], exp_avg[t], exp_avg_sq[t], vmax, grad[t], weight[t], begin, end, body_end, h, step_size[t], bc2_sqrt[t]);
    }
  }
}

}  // extern "C"
