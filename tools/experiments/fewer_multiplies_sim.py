"""CPU simulation of two ways below the direct convolution's multiplies, on the whole model (N = 2, 16 x 256 x 256,
129,032 outputs), against float64 truth and against the reference in that precision:

- 1-D Winograd F(2, 3) along the rows (16-bit): per kernel row, the transformed input B^T d = (d0 - d2, d1 + d2,
  d2 - d1, d1 - d3) and the transformed weights G g = (g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2), both computed
  in fp32 from the 16-bit values and rounded to the MMA type; their products summed over channels and kernel rows;
  then A^T m = (m0 + m1 + m2, m1 - m2 - m3).
- strict fp32 by fp16 hi/lo splits: v = hi + lo, hi = fp16(v), lo = fp16((v - hi) * 2^11) / 2^11 (the weights first
  scaled by a power of two into fp16's range), the products hi*hi + hi*lo + lo*hi.

Sums are exact (float64) and rounded to fp32 once: the tensor cores' fp32 accumulation order is not modelled, so a
kernel lands a little further off. Takes a minute or two on a CPU:

    python3 tools/experiments/fewer_multiplies_sim.py
"""
import math

import torch

N, C, H, W, K = 2, 16, 256, 256, 64


def head(y):
    """min over the channels, tanh twice."""
    return torch.tanh(torch.tanh(y.min(dim=1, keepdim=True)[0]))


def rnd(t, dt):
    return t.to(dt).to(torch.float64)


def maxabs(a, t):
    return (a - t).abs().max().item()


def main():
    torch.manual_seed(0)
    x = torch.rand(N, C, H, W, dtype=torch.float64)
    conv = torch.nn.Conv2d(C, K, 3)
    w, b = conv.weight.detach().double(), conv.bias.detach().double()
    truth = head(torch.nn.functional.conv2d(x, w, b))

    def reference(dt):  # the reference rounds its conv output to dt before its min
        y = torch.nn.functional.conv2d(rnd(x, dt), rnd(w, dt), rnd(b, dt)).to(dt).to(torch.float64)
        return rnd(head(y), dt)

    def direct(dt):
        y = torch.nn.functional.conv2d(rnd(x, dt), rnd(w, dt)) + rnd(b, dt)[None, :, None, None]
        return rnd(head(y.float().double()), dt)

    def f23(dt):
        xr, g = rnd(x, dt).float(), rnd(w, dt).float()
        oh, pairs = H - 2, (W - 2) // 2
        d = torch.stack([xr[..., 2 * j:2 * j + 4] for j in range(pairs)], dim=-2)  # N C H pairs 4
        bt = rnd(torch.stack([d[..., 0] - d[..., 2], d[..., 1] + d[..., 2], d[..., 2] - d[..., 1],
                              d[..., 1] - d[..., 3]], -1), dt)
        gg = rnd(torch.stack([g[..., 0], (g[..., 0] + g[..., 1] + g[..., 2]) / 2,
                              (g[..., 0] - g[..., 1] + g[..., 2]) / 2, g[..., 2]], -1), dt)  # K C 3 (kernel row) 4
        m = torch.zeros(N, K, oh, pairs, 4, dtype=torch.float64)
        for kh in range(3):
            m += torch.einsum("ncypt,kct->nkypt", bt[:, :, kh:kh + oh], gg[:, :, kh])
        m = m.float().double()
        y = torch.stack([m[..., 0] + m[..., 1] + m[..., 2], m[..., 1] - m[..., 2] - m[..., 3]], -1)
        y = y.reshape(N, K, oh, 2 * pairs) + rnd(b, dt)[None, :, None, None]
        return rnd(head(y.float().double()), dt)

    for dt in (torch.bfloat16, torch.float16):
        ref = reference(dt)
        for name, fn in (("direct", direct), ("F(2,3) 1-D", f23)):
            out = fn(dt)
            print(f"{str(dt):15s} {name:11s} vs reference {maxabs(out, ref):.2e}  vs float64 {maxabs(out, truth):.2e}"
                  f"  (reference vs float64 {maxabs(ref, truth):.2e})", flush=True)

    def split16(t, scale):
        ts = t * scale
        hi = ts.to(torch.float16).double()
        lo = ((ts - hi) * 2048).to(torch.float16).double() / 2048
        return hi / scale, lo / scale

    ref32 = head(torch.nn.functional.conv2d(x.float(), w.float(), b.float()).double())
    w_scale = 2.0 ** (15 - math.floor(math.log2(w.abs().max().item())))
    xh, xl = split16(x.float().double(), 1.0)
    wh, wl = split16(w.float().double(), w_scale)
    y = sum(torch.nn.functional.conv2d(p, q) for p, q in ((xh, wh), (xh, wl), (xl, wh))).float().double()
    out = head((y + b.float().double()[None, :, None, None]).float().double()).float().double()
    print(f"strict via fp16 hi/lo (3 products): vs fp32 reference {maxabs(out, ref32):.2e}, vs float64 "
          f"{maxabs(out, truth):.2e} (fp32 reference vs float64 {maxabs(ref32, truth):.2e}); split residual: x "
          f"{(x.float().double() - xh - xl).abs().max().item():.2e}, "
          f"w {(w.float().double() - wh - wl).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
