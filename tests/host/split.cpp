// split_tf32_bias on float bit patterns: what a tensor core reads of each part (its 19 top bits) must add up to the
// value exactly where |v| >= 2^-113 (each part then TF32 as it stands), within 2^-136 below; an infinity is part 0
// alone, a NaN stays a NaN in what the tensor core reads. Run as `split PART PARTS` (main.cpp): part PART of PARTS
// equal ranges of the 2^32 patterns, so that the parts run side by side; prints the patterns checked, how many split
// wrong and the first of those. test_split_tf32_bias_on_every_float runs every part and adds them up.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace host_split {
static float top(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  u &= 0xFFFFE000u;
  std::memcpy(&f, &u, 4);
  return f;
}
int run(int argc, char** argv) {
  if (argc != 4) return 2;
  const unsigned long long slice = std::strtoull(argv[2], nullptr, 10), slices = std::strtoull(argv[3], nullptr, 10);
  if (slices == 0 || slice >= slices) return 2;
  const unsigned long long begin = (slice << 32) / slices, end = ((slice + 1) << 32) / slices;
  unsigned long long bad = 0, checked = 0;
  unsigned first_bad = 0;
  for (unsigned long long b = begin; b < end; ++b) {
    const unsigned bits = (unsigned)b;
    float v;
    std::memcpy(&v, &bits, 4);
    float part[3];
    kb25::split_tf32_bias(v, part);
    const float t0 = top(part[0]), t1 = top(part[1]), t2 = top(part[2]);
    bool ok;
    if (std::isnan(v)) {
      ok = std::isnan(t0) && part[1] == 0.f && part[2] == 0.f;
    } else if (std::isinf(v)) {
      ok = t0 == v && part[1] == 0.f && part[2] == 0.f;
    } else {
      const double sum = (double)t0 + (double)t1 + (double)t2;
      ok = std::isfinite(part[0]) && (std::fabs((double)v) >= std::ldexp(1.0, -113)
                                          ? t0 == part[0] && t1 == part[1] && t2 == part[2] && sum == (double)v
                                          : std::fabs(sum - (double)v) < std::ldexp(1.0, -136));
    }
    if (!ok && bad++ == 0) first_bad = bits;
    ++checked;
  }
  std::printf("%llu %llu %08x\n", checked, bad, first_bad);
  return 0;
}
}  // namespace host_split
