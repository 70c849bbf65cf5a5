"""CPU only: the relative error of gm's factor (1 - tanh(t1)^2)(1 - tanh(m)^2), t1 = tanh(m), against float64, by
two fp32 routes: tanhf twice then 1 - t^2 (the reference's tanh_backward order), and the backward kernels' min_grad
(each 1 - tanh(v)^2 as 4e / (1 + e)^2, e = exp(-2|v|) by ex2.approx and rcp.approx; the inner factor 0 where
|m| >= 9.0109138, as tanhf's 1 - t^2). The SFU's ex2 is emulated as float64 exp2 rounded to fp32 and then perturbed
by up to 2^-22 relative (the PTX ISA's bound), rcp as float64 1/x rounded to fp32; tanhf as float64 tanh rounded to
fp32 (tanhf is within 2 ulps).

    python3 tools/experiments/min_grad_error.py
"""
import numpy as np

F32 = np.float32


def truth(m):
    t1 = np.tanh(m.astype(np.float64))
    return (1 - np.tanh(t1) ** 2) * (1 - t1 * t1)


def tanhf_route(m):
    t1 = np.tanh(m.astype(np.float64)).astype(F32)
    t2 = np.tanh(t1.astype(np.float64)).astype(F32)
    return (F32(1) - t2 * t2) * (F32(1) - t1 * t1)


def sfu_route(m, rng):
    def sech2_and_tanh(v):  # min_grad's tanh_terms, then 4 e r^2 and +-(1 - e) r
        a = F32(-2.8853900817779268) * np.abs(v)
        e = (np.exp2(a.astype(np.float64)) * (1 + rng.uniform(-2**-22, 2**-22, a.shape))).astype(F32)
        r = (1 / (F32(1) + e).astype(np.float64)).astype(F32)
        return F32(4) * e * r * r, np.copysign((F32(1) - e) * r, v)
    inner, t1 = sech2_and_tanh(m)
    inner = np.where(np.abs(m) >= F32(9.0109138), F32(0), inner)  # where tanhf(m) is +-1, as the reference's
    outer, _ = sech2_and_tanh(t1)
    return outer * inner


def main():
    rng = np.random.default_rng(0)
    bands = [(0, 1e-3), (1e-3, 1), (1, 3), (3, 6), (6, 9), (9, 13)]
    m = np.concatenate([rng.uniform(-lo - (hi - lo), -lo, 500_000) for lo, hi in bands] +
                       [rng.uniform(lo, hi, 500_000) for lo, hi in bands]).astype(F32)
    want = truth(m)
    for name, got in (("tanhf, 1 - t^2", tanhf_route(m)), ("min_grad (SFU)", sfu_route(m, rng))):
        rel = np.abs(got - want) / want
        for lo, hi in bands:
            s = (np.abs(m) >= lo) & (np.abs(m) < hi)
            print(f"{name}  |m| in [{lo:g}, {hi:g}): relative error max {rel[s].max():.2e}, mean {rel[s].mean():.2e}")


if __name__ == "__main__":
    main()
