// Online softmax over one block of scores for the G query heads of a KV group: scores -> weights in place, and
// the running max / denominator per head, rescaling acc (G × D) when a head's max grows. Shared by the quant decode
// bodies (int8/int4 and 2/3-bit; no include guard: each body is compiled once per instruction set inside its own
// namespace with `using V = <traits>`).
//
// The block max is taken a vector at a time (V::max(x, running): a NaN score never becomes the max, as with
// std::max(running, x)); a scalar max loop was a serial vmaxss chain, ~55 % of the softmax's time.

// online softmax over the block: scores -> weights in place; rescales acc / l when a head's max grows.
// Returns whether any head has a nonzero weight in the block.
inline bool block_softmax(float* sc, int64_t ps, int64_t G, int64_t D, int64_t m, float* mrun, float* lrun,
                          float* acc) {
  bool any = false;
  for (int64_t j = 0; j < G; ++j) {
    float* s = sc + j * ps;
    float bm = -INFINITY;
    int64_t t = 0;
    if (m >= V::W) {
      auto vmax = V::set1(-INFINITY);
      for (; t + V::W <= m; t += V::W) vmax = V::max(V::load(s + t), vmax);
      bm = V::hmax(vmax);
    }
    for (; t < m; ++t) bm = std::max(bm, s[t]);
    if (bm == -INFINITY) {  // every token of the block masked for this head
      std::fill(s, s + m, 0.f);
      continue;
    }
    any = true;
    if (bm > mrun[j]) {
      const float f = mrun[j] == -INFINITY ? 0.f : std::exp(mrun[j] - bm);
      lrun[j] *= f;
      float* aj = acc + j * D;
      const auto vf = V::set1(f);
      for (int64_t i = 0; i < D; i += V::W) V::store(aj + i, V::mul(V::load(aj + i), vf));
      mrun[j] = bm;
    }
    const auto vm = V::set1(mrun[j]);
    auto vsum = V::zero();
    t = 0;
    for (; t + V::W <= m; t += V::W) {
      const auto p = V::exp(V::sub(V::load(s + t), vm));
      V::store(s + t, p);
      vsum = V::add(vsum, p);
    }
    float sum = V::hsum(vsum);
    for (; t < m; ++t) {
      const float x = s[t] - mrun[j];
      s[t] = x < kvslim_vec::kExpLo ? 0.f : std::exp(x);
      sum += s[t];
    }
    lrun[j] += sum;
  }
  return any;
}
