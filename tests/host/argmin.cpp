// keep_min (the saving epilogues' combine) folded over pixels of channel values. Each input line: n, then n floats as
// their bits. Each output line: the (value bits, channel) that keep_min leaves when folding the values in order, in
// reverse order, and as a butterfly (pairs, then pairs of pairs, ...); then what scan_min (the in-register scans)
// and scan_min_finite (the guarded kernels' scan, for lines without a NaN) leave scanning them in order. Run as
// `argmin` (main.cpp); test_argmin_order_is_torch_mins_in_any_fold_order checks it against torch.min.
#include <cstdio>
#include <cstring>

namespace host_argmin {
int run(int, char**) {
  int n;
  while (std::scanf("%d", &n) == 1) {
    float v[64];
    int ch[64];
    for (int i = 0; i < n; ++i) {
      unsigned bits;
      std::scanf("%x", &bits);
      std::memcpy(&v[i], &bits, 4);
    }
    float a = v[0], b = v[n - 1], s = v[0], f = v[0];
    int ia = 0, ib = n - 1, is = 0, jf = 0;
    for (int i = 1; i < n; ++i) kb25::keep_min(a, ia, v[i], i);
    for (int i = 1; i < n; ++i) kb25::scan_min(s, is, v[i], i);
    for (int i = 1; i < n; ++i) kb25::scan_min_finite(f, jf, v[i], i);
    for (int i = n - 2; i >= 0; --i) kb25::keep_min(b, ib, v[i], i);
    for (int i = 0; i < n; ++i) ch[i] = i;
    for (int step = 1; step < n; step *= 2)
      for (int i = 0; i + step < n; i += 2 * step) kb25::keep_min(v[i], ch[i], v[i + step], ch[i + step]);
    unsigned ba, bb, bc, bs, bf;
    std::memcpy(&ba, &a, 4);
    std::memcpy(&bb, &b, 4);
    std::memcpy(&bc, &v[0], 4);
    std::memcpy(&bs, &s, 4);
    std::memcpy(&bf, &f, 4);
    std::printf("%08x %d %08x %d %08x %d %08x %d %08x %d\n", ba, ia, bb, ib, bc, ch[0], bs, is, bf, jf);
  }
  return 0;
}
}  // namespace host_argmin
