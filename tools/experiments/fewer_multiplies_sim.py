"""CPU simulation of two ways below the direct convolution's multiplies, on the whole model (N = 2, 16 x 256 x 256,
129,032 outputs), against float64 truth and against the reference in that precision:

- 1-D Winograd F(2, 3) along the rows (16-bit): per kernel row, the transformed input B^T d = (d0 - d2, d1 + d2,
  d2 - d1, d1 - d3) and the transformed weights G g = (g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2), both computed
  in fp32 from the 16-bit values and rounded to the MMA type; their products summed over channels and kernel rows;
  then A^T m = (m0 + m1 + m2, m1 - m2 - m3).
- strict fp32 by fp16 hi/lo splits: v = hi + lo, hi = fp16(v), lo = fp16((v - hi) * 2^11) / 2^11 (the weights first
  scaled by a power of two into fp16's range), the products hi*hi + hi*lo + lo*hi.
- strict fp32 by Winograd F(2x2, 3x3) on those splits, with a fused kernel's roundings: V = B^T d B and U = G g G^T
  in fp32 arithmetic (each add rounded), both split into fp16 hi/lo, each point's three products (K = 16) into one
  fp32 accumulator (each MMA's exact sum rounded as it is added; the bias as C of the first at the point (1, 1), where
  A^T . A adds it to all four outputs) or the small ones into a second, then A^T M A in fp32.

Sums are exact (float64) and rounded to fp32 once (the Winograd rows: once per MMA): the tensor cores' accumulation
order is not modelled, so a kernel lands a little further off. Takes seconds on a CPU:

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

    for one in (True, False):
        out = head(strict_f22(x, w, b, one_accumulator=one).double())
        print(f"strict via F(2x2) on fp16 hi/lo, {'one accumulator' if one else 'small products apart'}: vs fp32 "
              f"reference {maxabs(out, ref32):.2e}, vs float64 {maxabs(out, truth):.2e}", flush=True)


def strict_f22(x, w, b, one_accumulator):
    """The conv (before the min) as the fused strict Winograd kernel would compute it, in float32 (module docstring)."""
    f32 = torch.float32
    xf, g, bf = x.to(f32), w.to(f32), b.to(f32)
    # G g G^T in fp32: rows g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2, then the same over the columns.
    def g_rows(t):  # t[..., 3, :] -> [..., 4, :]
        s = t[..., 0, :] + t[..., 2, :]
        return torch.stack([t[..., 0, :], (s + t[..., 1, :]) * 0.5, (s - t[..., 1, :]) * 0.5, t[..., 2, :]], -2)
    u = g_rows(g_rows(g).transpose(-1, -2)).transpose(-1, -2)  # K C 4 4
    scale = 2.0 ** (14 - math.floor(math.log2(max(u.abs().max().item(), bf.abs().max().item()))))

    def split(t, s):  # hi + lo * 2^-11 of t * s, as float64 parts of the scaled value
        ts = t.double() * s
        hi = ts.to(torch.float16).double()
        return hi, ((ts - hi) * 2048).to(torch.float16).double() / 2048

    uh, ul = split(u, scale)
    outs = []
    def b_rows(t):  # B^T t over dim -2
        r = [t[..., k, :] for k in range(4)]
        return torch.stack([r[0] - r[2], r[1] + r[2], r[2] - r[1], r[1] - r[3]], -2)

    def prod(p, q):  # exact: 22-bit products, 16 terms
        return torch.einsum("ctuij,kcij->ktuij", p, q)

    c = torch.zeros(1, 1, 1, 4, 4, dtype=torch.float64)
    c[..., 1, 1] = 1.0
    bias = (bf.double() * scale)[:, None, None, None, None] * c  # at point (1, 1): A^T . A adds it to all 4 outputs
    for n in range(x.shape[0]):
        d = xf[n].unfold(1, 4, 2).unfold(2, 4, 2)  # C ty tx 4 4 (rows i, columns j)
        v = b_rows(b_rows(d).transpose(-1, -2)).transpose(-1, -2)
        vh, vl = split(v, 1.0)
        big = prod(vh, uh)
        if one_accumulator:
            m = (big + bias).to(f32)
            m = (m.double() + prod(vh, ul)).to(f32)
            m = (m.double() + prod(vl, uh)).to(f32)
        else:
            small = (prod(vh, ul).to(f32).double() + prod(vl, uh)).to(f32)
            m = ((big + bias).to(f32) + small)
        m = m * (1.0 / scale)  # a power of two: exact
        r0 = m[..., 0, :] + m[..., 1, :] + m[..., 2, :]
        r1 = m[..., 1, :] - m[..., 2, :] - m[..., 3, :]
        y = torch.stack([torch.stack([r0[..., 0] + r0[..., 1] + r0[..., 2], r0[..., 1] - r0[..., 2] - r0[..., 3]], -1),
                         torch.stack([r1[..., 0] + r1[..., 1] + r1[..., 2], r1[..., 1] - r1[..., 2] - r1[..., 3]], -1)],
                        -2)  # K ty tx 2 2
        outs.append(y.permute(0, 1, 3, 2, 4).reshape(y.shape[0], 2 * y.shape[1], 2 * y.shape[2]))
    return torch.stack(outs)


if __name__ == "__main__":
    main()
