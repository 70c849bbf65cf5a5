"""clock64 timeline of the wgmma fused kernels (two consumer warpgroups fed by producer warps): for each consumer step,
when the consumer has its rows, has issued its MMAs, has written the step before, has its MMAs back and has reduced;
for each input row, when its producer thread has loaded it, got its slot and stored it. The stamps go into a copy of
model_new.py (blocks 0-3; thread 0 of each consumer warpgroup and of each consumer's producer threads), built under
its own extension name in a temporary directory; the project's build is not touched. Prints, in SM cycles:

- per block and consumer, medians over steps 10-110 of the period and of its parts (rows, issue, write, wait,
  reduce), the producer's load, slot wait and store. Since v27 the TF32 and 16-bit wgmma kernels wait for a step's
  newest row inside the issue, so their "rows" part holds only the older rows' waits (at a strip's start) and
  "issue" the newest row's: compare those two parts with earlier versions' timelines only summed;
- the two consumers' phase (consumer 1's issue start minus consumer 0's);
- over the same steps of each block: the share of time with no consumer's MMAs in flight (from issue start to the
  wait's return) and with both;
- 8 steps of block 0, each stamp relative to the first.

Timing only: each stamp is a clock read and a global store, so the kernel runs a few percent slower than without.

    python3 tools/experiments/timeline.py                     # sm90_bf16 and sm90_tf32
    python3 tools/experiments/timeline.py sm90_fp16 --steps 20 60
"""
import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
BLOCKS, STEPS, ROWS = 4, 128, 192  # stamped blocks, steps a consumer, rows a producer
CONSUMER_STAMPS = ("top", "rows", "issue", "write", "wait", "reduce")
PRODUCER_STAMPS = ("top", "load", "slot", "store")
PRODUCER_BASE = BLOCKS * 2 * STEPS * 8
STAMP_COUNT = PRODUCER_BASE + BLOCKS * 2 * ROWS * 4


def accessor_edits(suffix, anchor, count):
    """The edits that give a stamped copy its own extension name (kb25_conv_min_tanh2_<suffix>) and `count` stamps in
    a __device__ buffer, placed before `anchor`, which timeline_stamp (declared in both translation units and exported
    to Python) clears, copies out and reads."""
    return (
        ('EXTENSION_NAME = "kb25_conv_min_tanh2"\n', f'EXTENSION_NAME = "kb25_conv_min_tanh2_{suffix}"\n'),
        ('extern "C" int fused_kernel_smem_bytes(int kernel);\n',
         'extern "C" int fused_kernel_smem_bytes(int kernel);\nextern "C" long long timeline_stamp(int i);\n', 2),
        ('"run_fused_kernel", "fused_kernel_smem_bytes", "fused_kernel_launches"]',
         '"run_fused_kernel", "fused_kernel_smem_bytes", "fused_kernel_launches", "timeline_stamp"]'),
        (anchor,
         f"__device__ unsigned long long kb25_stamps[{count}];\n"
         "// i = -1: clear the stamps; i = 0: copy them out and return the first; i > 0: return stamp i of that copy.\n"
         'extern "C" long long timeline_stamp(int i) {\n'
         f"  static unsigned long long host[{count}];\n"
         "  if (i < 0) {\n"
         "    for (unsigned long long& h : host) h = 0;\n"
         "    return cudaMemcpyToSymbol(kb25_stamps, host, sizeof(host)) == cudaSuccess ? 0 : -1;\n"
         "  }\n"
         "  if (i == 0 && cudaMemcpyFromSymbol(host, kb25_stamps, sizeof(host)) != cudaSuccess) return -1;\n"
         "  return (long long)host[i];\n"
         "}\n" + anchor),
    )


# (anchor in model_new.py, its replacement[, copies]): each anchor must be there exactly once (or `copies` times).
EDITS = accessor_edits("timeline", "// A producer thread's walk over one consumer's rows", STAMP_COUNT) + (
    # producer: top of a row, loads issued, slot acquired, row committed
    ("  for (uint32_t d = 0; ahead.valid(); ++d) {\n",
     f"  const bool stamp = blockIdx.x < {BLOCKS} && threadIdx.x % Traits::kProducerThreads == 0;\n"
     f"  const int sbase = {PRODUCER_BASE} + (blockIdx.x * 2 + threadIdx.x / Traits::kProducerThreads) * {ROWS} * 4;\n"
     f"#define KB25_PSTAMP(k) if (stamp && d < {ROWS}) kb25_stamps[sbase + d * 4 + (k)] = clock64()\n"
     "  for (uint32_t d = 0; ahead.valid(); ++d) {\n"
     "    KB25_PSTAMP(0);\n"),
    ("    ring.acquire(d);\n", "    KB25_PSTAMP(1);\n    ring.acquire(d);\n    KB25_PSTAMP(2);\n"),
    ("    ring.commit(d);\n", "    ring.commit(d);\n    KB25_PSTAMP(3);\n"),
    # consumer: top of a step, rows in, MMAs issued, previous step written, MMAs landed, reduced
    ("      for (int64_t s = begin; s < end; ++s, at.advance()) {\n",
     f"      const bool stamp = blockIdx.x < {BLOCKS} && ctid == 0;\n"
     f"      const int cbase = (blockIdx.x * 2 + c) * {STEPS} * 8;\n"
     f"#define KB25_STAMP(k) if (stamp && s - begin < {STEPS}) kb25_stamps[cbase + (s - begin) * 8 + (k)] = clock64()\n"
     "      for (int64_t s = begin; s < end; ++s, at.advance()) {\n"
     "        KB25_STAMP(0);\n"),
    # "rows": the rows waited for before start() (wgmma waits for the newest one inside it, within "issue")
    ("        rows += fresh - now;\n", "        rows += fresh - now;\n        KB25_STAMP(1);\n"),
    ("          mainloop.start(acc, window, col0, OW, release_oldest, [&] { rows_in.wait(newest); });\n        }\n"
     "        if (s != begin) epilogue.write(pending, row_out(pending_row), pending_col0, OW);\n"
     "        mainloop.finish(acc, release_oldest);\n",
     "          mainloop.start(acc, window, col0, OW, release_oldest, [&] { rows_in.wait(newest); });\n        }\n"
     "        KB25_STAMP(2);\n"
     "        if (s != begin) epilogue.write(pending, row_out(pending_row), pending_col0, OW);\n        KB25_STAMP(3);\n"
     "        mainloop.finish(acc, release_oldest);\n        KB25_STAMP(4);\n"),
    ("        pending = epilogue.reduce(acc);\n        pending_row",
     "        pending = epilogue.reduce(acc);\n        KB25_STAMP(5);\n        pending_row"),
)


def stamped_source(text, edits=EDITS, tool="timeline"):
    """model_new.py's text with the stamps in; fails naming the first anchor that is not there exactly once."""
    for anchor, replacement, *copies in edits:
        copies = copies[0] if copies else 1
        count = text.count(anchor)
        if count != copies:
            raise ValueError(f"{tool}: expected {copies} cop{'y' if copies == 1 else 'ies'} of "
                             f"{anchor.strip()[:60]!r} in model_new.py, found {count}")
        text = text.replace(anchor, replacement)
    return text


def use_stamped_copy(text, work):
    """Write the stamped model_new.py into `work` beside harness.py and reference.py, and make it the one imported
    (its extension built under `work`)."""
    with open(os.path.join(work, "model_new.py"), "w") as f:
        f.write(text)
    for name in ("harness.py", "reference.py"):
        shutil.copy(os.path.join(HERE, name), work)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(work, "ext"))
    sys.path.insert(0, work)


def intervals_share(a, b, lo, hi):
    """Shares of [lo, hi) covered by none and by both of two lists of intervals (each list disjoint, sorted)."""
    events = sorted([(max(s, lo), 1) for s, e in a + b if e > lo and s < hi] +
                    [(min(e, hi), -1) for s, e in a + b if e > lo and s < hi])
    none = both = 0
    depth, t = 0, lo
    for at, step in events:
        none += (at - t) if depth == 0 else 0
        both += (at - t) if depth >= 2 else 0
        depth, t = depth + step, at
    none += hi - t
    return none / (hi - lo), both / (hi - lo)


def report(name, stamp, first, last):
    print(f"=== {name} (steps {first}..{last - 1}, SM cycles)")
    for blk in range(BLOCKS):
        cons = [[stamp[((blk * 2 + c) * STEPS + i) * 8:((blk * 2 + c) * STEPS + i) * 8 + 6] for i in range(STEPS)]
                for c in range(2)]
        prod = [[stamp[PRODUCER_BASE + ((blk * 2 + c) * ROWS + d) * 4:PRODUCER_BASE + ((blk * 2 + c) * ROWS + d) * 4 + 4]
                 for d in range(ROWS)] for c in range(2)]
        for c in range(2):
            steps = cons[c][first:last]
            if any(v == 0 for r in cons[c][first:last + 1] for v in r):
                print(f"block {blk} consumer {c}: fewer than {last + 1} steps stamped")
                break
            period = [cons[c][i + 1][0] - cons[c][i][0] for i in range(first, last)]
            parts = "  ".join(f"{k} {statistics.median(r[j + 1] - r[j] for r in steps):5.0f}"
                              for j, k in enumerate(CONSUMER_STAMPS[1:]))
            rows = prod[c][first:last]
            pparts = "  ".join(f"{k} {statistics.median(r[j + 1] - r[j] for r in rows):5.0f}"
                               for j, k in enumerate(PRODUCER_STAMPS[1:]))
            print(f"block {blk} consumer {c}: period {statistics.median(period):5.0f} ({min(period)}-{max(period)})  "
                  f"{parts}  | producer {pparts}")
        else:
            phase = [cons[1][i][1] - cons[0][i][1] for i in range(first, last)]
            mmas = [[(r[1], r[4]) for r in cons[c][first:last]] for c in range(2)]
            lo = max(cons[0][first][1], cons[1][first][1])
            hi = min(cons[0][last - 1][4], cons[1][last - 1][4])
            none, both = intervals_share(mmas[0], mmas[1], lo, hi)
            print(f"block {blk}: phase {statistics.median(phase):6.0f} ({min(phase)}..{max(phase)}); no MMAs in flight "
                  f"{100 * none:4.1f}% of the time, both consumers' {100 * both:4.1f}%")
            if blk == 0:
                t0 = cons[0][first][0]
                print("  step consumer: " + " ".join(f"{k:>7s}" for k in CONSUMER_STAMPS))
                for i in range(first, min(first + 8, last)):
                    for c in range(2):
                        print(f"  {i:4d} {c:8d}: " + " ".join(f"{v - t0:7d}" for v in cons[c][i]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", default=["sm90_bf16", "sm90_tf32"], help="names in FUSED_KERNELS")
    p.add_argument("--steps", nargs=2, type=int, default=[10, 110], metavar=("FIRST", "LAST"))
    args = p.parse_args()
    first, last = args.steps
    if not 0 <= first < last < STEPS:
        p.error(f"--steps: expected 0 <= FIRST < LAST < {STEPS}, got {first} {last}")
    work = tempfile.mkdtemp(prefix="kb25_timeline_")
    try:
        with open(os.path.join(HERE, "model_new.py")) as f:
            text = f.read()
        wgmma = re.findall(r'FusedKernel\("(\w+)", "wgmma"', text)
        for name in args.kernels:
            if name not in wgmma:
                p.error(f"expected a wgmma kernel ({', '.join(wgmma)}), got {name!r}")
        use_stamped_copy(stamped_source(text), work)
        import torch
        import harness
        import model_new
        import reference

        full = (reference.batch_size, reference.in_channels, reference.height, reference.width)
        for name in args.kernels:
            case = harness.CASES[f"kernel-{name}"]
            _, fn = harness.case_model(case)
            x = harness.make_input(full, seed=3, device="cuda").to(harness.PRECISIONS[case.precision].dtype)
            for _ in range(2):  # warm: the shared-memory opt-in, the caches
                fn(x)
            torch.cuda.synchronize()
            if model_new._ext.timeline_stamp(-1) != 0:  # no stamp of another kernel or launch left over
                raise RuntimeError("timeline: could not clear the stamps")
            fn(x)
            torch.cuda.synchronize()
            stamp = [model_new._ext.timeline_stamp(i) for i in range(STAMP_COUNT)]  # i = 0 copies them out
            report(name, stamp, first, last)
            del x, fn
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
