// kvslim::quant_write — symmetric grouped int8 / int4 quantization of new rows straight into a store's slots.
//
//   y = x / channel (when given; key smoothing), per group of `group_size` values:
//   scale = clamp(max|y| / qmax, tiny, max of the scale dtype) stored in the scale dtype,
//   code  = clamp(round_half_even(y / scale_stored), -qmax, qmax)       (qmax 127 for int8, 7 for int4)
//
// the arithmetic of kvslim.ops.quant.quantize (one fp32 division per step, as torch does), written into
// codes[:, :, start:start + S] (int8, or packed int4 nibbles, element 2i low) and scale[:, :, start:start + S].
// One call replaces a dozen small torch ops per decode step. Returns false (nothing written) when x holds a
// non-finite value: the caller then raises its named error. Sizes, dtypes and slots are checked (ValueError).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr const char* OP = "kvslim::quant_write";

template <class S>
float stored(float s) {  // clamp to the scale dtype's normal range, round to it, back to fp32
  const float lo = static_cast<float>(std::numeric_limits<S>::min());
  const float hi = static_cast<float>(std::numeric_limits<S>::max());
  return static_cast<float>(static_cast<S>(std::min(std::max(s, lo), hi)));
}

template <class S>
void quantize_rows(const at::Tensor& x, const float* ch, int64_t ch_bs, int64_t ch_hs, int bits, int64_t gs,
                   int64_t start, at::Tensor& codes, at::Tensor& scale) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const float qm = static_cast<float>((1 << (bits - 1)) - 1);
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  S* sp = scale.data_ptr<S>();
  std::vector<float> y(D);
  std::vector<int8_t> q(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + ((b * H + h) * T + t) * D;
        const float* cr = ch ? ch + b * ch_bs + h * ch_hs : nullptr;
        for (int64_t i = 0; i < D; ++i) y[i] = cr ? xr[i] / cr[i] : xr[i];
        S* srow = sp + b * scale.stride(0) + h * scale.stride(1) + (start + t) * scale.stride(2);
        for (int64_t g = 0; g < D / gs; ++g) {
          float amax = 0.f;
          for (int64_t i = g * gs; i < (g + 1) * gs; ++i) amax = std::max(amax, std::fabs(y[i]));
          const S s_stored = static_cast<S>(stored<S>(amax / qm));
          srow[g] = s_stored;
          const float s = static_cast<float>(s_stored);
          for (int64_t i = g * gs; i < (g + 1) * gs; ++i)
            q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(y[i] / s), -qm), qm));
        }
        uint8_t* crow = cp + b * codes.stride(0) + h * codes.stride(1) + (start + t) * codes.stride(2);
        if (bits == 8) {
          for (int64_t i = 0; i < D; ++i) crow[i] = static_cast<uint8_t>(q[i]);
        } else {
          for (int64_t i = 0; i < D; i += 2)
            crow[i / 2] = static_cast<uint8_t>((q[i] & 0xF) | ((q[i + 1] & 0xF) << 4));
        }
      }
}

}  // namespace

bool quant_write_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& channel, int64_t bits,
                     int64_t group_size, int64_t start, at::Tensor codes, at::Tensor scale) {
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 4, OP,
                    ": x must be a float32 (B, H, S, D) CPU tensor, got ", x_in.scalar_type(), " ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, OP, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(group_size > 0 && D % group_size == 0 && (bits == 8 || group_size % 2 == 0), OP,
                    ": group_size=", group_size, " must divide the head dimension ", D, " (even for int4)");
  const int64_t width = bits == 8 ? D : D / 2;
  TORCH_CHECK_VALUE(codes.device().is_cpu() && codes.dim() == 4 && codes.size(0) == B && codes.size(1) == H &&
                        codes.size(3) == width && codes.stride(3) == 1 &&
                        codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
                    OP, ": codes must be ", bits == 8 ? "int8" : "uint8", " (B=", B, ", H=", H, ", slots, ", width,
                    ") with unit last stride, got ", codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK_VALUE(scale.device().is_cpu() && scale.dim() == 4 && scale.size(0) == B && scale.size(1) == H &&
                        scale.size(2) == codes.size(2) && scale.size(3) == D / group_size && scale.stride(3) == 1,
                    OP, ": scale must be (B=", B, ", H=", H, ", ", codes.size(2), " slots, ", D / group_size,
                    ") with unit last stride, got ", scale.sizes());
  TORCH_CHECK_VALUE(start >= 0 && start + T <= codes.size(2), OP, ": slots [", start, ", ", start + T,
                    ") are outside the store's ", codes.size(2), " slots");
  const float* ch = nullptr;
  int64_t ch_bs = 0, ch_hs = 0;
  at::Tensor c;
  if (channel.has_value()) {
    c = *channel;
    TORCH_CHECK_VALUE(c.device().is_cpu() && c.scalar_type() == at::kFloat && c.dim() == 4 &&
                          (c.size(0) == B || c.size(0) == 1) && (c.size(1) == H || c.size(1) == 1) &&
                          c.size(2) == 1 && c.size(3) == D,
                      OP, ": channel must be float32 (B|1, H|1, 1, D=", D, "), got ", c.scalar_type(), " ",
                      c.sizes());
    c = c.contiguous();
    ch = c.data_ptr<float>();
    ch_bs = c.size(0) == 1 ? 0 : c.stride(0);
    ch_hs = c.size(1) == 1 ? 0 : c.stride(1);
  }
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(xp[i])) return false;  // nothing written: the caller raises its named error
  const int b = static_cast<int>(bits);
  if (scale.scalar_type() == at::kFloat) quantize_rows<float>(x, ch, ch_bs, ch_hs, b, group_size, start, codes, scale);
  else if (scale.scalar_type() == at::kHalf) quantize_rows<c10::Half>(x, ch, ch_bs, ch_hs, b, group_size, start, codes, scale);
  else if (scale.scalar_type() == at::kBFloat16)
    quantize_rows<c10::BFloat16>(x, ch, ch_bs, ch_hs, b, group_size, start, codes, scale);
  else TORCH_CHECK_VALUE(false, OP, ": scale must be float32, float16 or bfloat16, got ", scale.scalar_type());
  return true;
}

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quant_write(Tensor x, Tensor? channel, int bits, int group_size, int start, Tensor(a!) codes, "
        "Tensor(b!) scale) -> bool");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("quant_write", &quant_write_cpu); }
