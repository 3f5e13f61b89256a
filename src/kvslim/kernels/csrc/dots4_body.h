// out[k] = x · M[k] for k < nk, rows M[k] (len values) `ms` apart: four rows per pass, so each x vector is loaded
// once per four rows and the four sums are reduced together (V::hsum4) instead of one full reduction per output.
// Shared by the shared-rows and quant decode bodies (no include guard: each body is compiled once per instruction
// set inside its own namespace with `using V = <traits>`; both trait families derive from vec_slim.h's).
inline void dots4(const float* x, const float* M, int64_t len, int64_t nk, int64_t ms, float* out) {
  int64_t k = 0;
  for (; k + 4 <= nk; k += 4) {
    const float *m0 = M + k * ms, *m1 = m0 + ms, *m2 = m1 + ms, *m3 = m2 + ms;
    auto a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    int64_t i = 0;
    for (; i + V::W <= len; i += V::W) {
      const auto xv = V::load(x + i);
      a0 = V::fma(xv, V::load(m0 + i), a0);
      a1 = V::fma(xv, V::load(m1 + i), a1);
      a2 = V::fma(xv, V::load(m2 + i), a2);
      a3 = V::fma(xv, V::load(m3 + i), a3);
    }
    float s[4];
    V::hsum4(a0, a1, a2, a3, s);
    for (; i < len; ++i) {
      s[0] += x[i] * m0[i];
      s[1] += x[i] * m1[i];
      s[2] += x[i] * m2[i];
      s[3] += x[i] * m3[i];
    }
    for (int r = 0; r < 4; ++r) out[k + r] = s[r];
  }
  for (; k < nk; ++k) {
    const float* m = M + k * ms;
    auto a = V::zero();
    int64_t i = 0;
    for (; i + V::W <= len; i += V::W) a = V::fma(V::load(x + i), V::load(m + i), a);
    float sum = V::hsum(a);
    for (; i < len; ++i) sum += x[i] * m[i];
    out[k] = sum;
  }
}
