"""clock64 timeline of the fed weight-gradient kernel (grad_weight_fed.cuh) at N = 128 on bench.py's parameters: for
each input row its producer (thread 0 of the CTA) stamps when it waits for the row's staged copies, has them, starts
storing, has its slot, has stored the body, has passed the record's barrier and has committed the row; for each step
each consumer warp (lane 0: the three row warps and the bias warp) stamps its top, its rows in, its chunk loop done
(the last batch's), its sums added and its release. The stamps go into a copy of model_new.py (blocks 0-3), built
under its own extension name in a temporary directory; the project's build is not touched. Prints, in SM cycles, per
block: the medians over rows (steps) FIRST .. LAST - 1 of the producer's row period and its parts, and of each
consumer warp's step period and its parts; then 8 rows and steps of block 0 relative to the first.

Timing only: each stamp is a clock read and a global store, so the kernel runs a few percent slower than without.

    python3 tools/experiments/dw_timeline.py                  # float32 x (TF32), bf16 and fp16
    python3 tools/experiments/dw_timeline.py tf32 --steps 10 110 --source other/model_new.py
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

import timeline

HERE = timeline.HERE  # the repo root
BLOCKS, STEPS, ROWS = 4, 128, 128  # stamped blocks, steps a consumer warp, rows a producer
WARPS = 4  # consumer warps: row offsets 0-2, the bias
PRODUCER_STAMPS = ("wait", "staged", "store", "slot", "body", "barrier", "commit")
CONSUMER_STAMPS = ("top", "rows", "loop", "sums", "release")
SEED = 0  # bench.py's default seed: its parameters, so its argmins (the fed kernel's steps depend on them)
PRODUCER_BASE = BLOCKS * WARPS * STEPS * 8
STAMP_COUNT = PRODUCER_BASE + BLOCKS * ROWS * 8

# (anchor in model_new.py, its replacement[, copies]): each anchor must be there exactly once (or `copies` times).
EDITS = timeline.accessor_edits("dw_timeline", "// The producer's tag for the fed dW: Tf32OnF16's narrowing",
                                STAMP_COUNT) + (
    # producer
    ("      const typename G::Producer producer(x, H, W, ptid);\n",
     "      const typename G::Producer producer(x, H, W, ptid);\n"
     f"      const bool pstamp = blockIdx.x < {BLOCKS} && ptid == 0;\n"
     f"#define KB25_PSTAMP(k) if (pstamp && row_no < {ROWS}) "
     f"kb25_stamps[{PRODUCER_BASE} + (blockIdx.x * {ROWS} + row_no) * 8 + (k)] = clock64()\n"),
    ("          cp_async_wait_all();\n          producer.read_staged(in.row, stage);\n",
     "          KB25_PSTAMP(0);\n          cp_async_wait_all();\n          producer.read_staged(in.row, stage);\n"
     "          KB25_PSTAMP(1);\n"),
    ("        const int col0 = f.col0;\n        ring.acquire(row_no);\n",
     "        const int col0 = f.col0;\n        KB25_PSTAMP(2);\n"
     "        ring.acquire(row_no);\n        KB25_PSTAMP(3);\n"),
    ("        if (f.record) {\n          uint32_t* const hk",
     "        KB25_PSTAMP(4);\n        if (f.record) {\n          uint32_t* const hk"),
    ("          named_barrier<G::kProducerThreads>(G::kProducerBarrier);\n          uint64_t held = 0;",
     "          named_barrier<G::kProducerThreads>(G::kProducerBarrier);\n          KB25_PSTAMP(5);\n"
     "          uint64_t held = 0;"),
    ("          ++records;\n        }\n        ring.commit(row_no);\n",
     "          ++records;\n        }\n        ring.commit(row_no);\n        KB25_PSTAMP(6);\n"),
    # consumers
    ("      for (int64_t step = begin; step < end; ++step, at.advance()) {\n"
     "        const int fresh = RowCursor::new_rows(step == begin || at.oy == 0);\n",
     f"      const bool cstamp = blockIdx.x < {BLOCKS} && lane == 0;\n"
     f"#define KB25_CSTAMP(k) if (cstamp && step - begin < {STEPS}) "
     f"kb25_stamps[((blockIdx.x * {WARPS} + cw) * {STEPS} + (step - begin)) * 8 + (k)] = clock64()\n"
     "      for (int64_t step = begin; step < end; ++step, at.advance()) {\n        KB25_CSTAMP(0);\n"
     "        const int fresh = RowCursor::new_rows(step == begin || at.oy == 0);\n"),
    ("          walks = walks << 1 | (row_walks(ring.slot(rows)) ? 1u : 0u);\n        }\n",
     "          walks = walks << 1 | (row_walks(ring.slot(rows)) ? 1u : 0u);\n        }\n        KB25_CSTAMP(1);\n"),
    # a batch's chunk loop done (the last batch's, where a step takes several), before its sums
    ("            const bool carries = batch == 0 && tq == 0;\n",
     "            KB25_CSTAMP(2);\n            const bool carries = batch == 0 && tq == 0;\n"),
    ("            // row 0 (lanes 0-3): column 2 tq (+ 1), rank 8 batch + column\n",
     "            KB25_CSTAMP(2);\n            // row 0 (lanes 0-3): column 2 tq (+ 1), rank 8 batch + column\n"),
    ("        __syncwarp();  // this step's sums before another lane's next ones\n        ring.release(rows - 3);\n",
     "        KB25_CSTAMP(3);\n        __syncwarp();  // this step's sums before another lane's next ones\n"
     "        ring.release(rows - 3);\n        KB25_CSTAMP(4);\n"),
)


def stamped_source(text):
    """model_new.py's text with the stamps in; fails naming the first anchor that is not there exactly once."""
    return timeline.stamped_source(text, EDITS, "dw_timeline")


def medians(rows, names, first, last):
    """'name median' of each interval between consecutive stamps (both set) over rows first .. last - 1."""
    parts = []
    for j in range(1, len(names)):
        d = [r[j] - r[j - 1] for r in rows[first:last] if r[j] and r[j - 1]]
        parts.append(f"{names[j]} {statistics.median(d):5.0f}" if d else f"{names[j]}     -")
    return "  ".join(parts)


def report(name, stamp, first, last):
    print(f"=== {name} (rows and steps {first}..{last - 1}, SM cycles)")
    for blk in range(BLOCKS):
        prod = [stamp[PRODUCER_BASE + (blk * ROWS + d) * 8:PRODUCER_BASE + (blk * ROWS + d) * 8 + 7]
                for d in range(ROWS)]
        top = 2  # the store's top: stamped for every x type (0, 1 only where the rows are staged)
        period = [prod[d + 1][top] - prod[d][top] for d in range(first, last) if prod[d + 1][top] and prod[d][top]]
        if not period:
            print(f"block {blk}: fewer than {last + 1} rows stamped")
            continue
        print(f"block {blk} producer: row period {statistics.median(period):5.0f}  "
              + medians(prod, PRODUCER_STAMPS, first, last))
        for w in range(WARPS):
            cons = [stamp[((blk * WARPS + w) * STEPS + s) * 8:((blk * WARPS + w) * STEPS + s) * 8 + 5]
                    for s in range(STEPS)]
            per = [cons[s + 1][0] - cons[s][0] for s in range(first, last) if cons[s + 1][0] and cons[s][0]]
            gap = [cons[s + 1][0] - cons[s][4] for s in range(first, last) if cons[s + 1][0] and cons[s][4]]
            if not per:
                print(f"block {blk} warp {w}: fewer than {last + 1} steps stamped")
                continue
            role = "bias warp" if w == 3 else f"row warp {w}"
            print(f"block {blk} {role}: step period {statistics.median(per):5.0f}  "
                  + medians(cons, CONSUMER_STAMPS, first, last) + f"  next {statistics.median(gap):5.0f}")
        if blk == 0:
            t0 = prod[first][top]
            print("  row  producer: " + " ".join(f"{k:>7s}" for k in PRODUCER_STAMPS))
            for d in range(first, min(first + 8, last)):
                print(f"  {d:4d}          " + " ".join(f"{v - t0:7d}" if v else "      -" for v in prod[d]))
            print("  step warp: " + " ".join(f"{k:>7s}" for k in CONSUMER_STAMPS))
            for s in range(first, min(first + 8, last)):
                for w in range(WARPS):
                    c = stamp[((blk * WARPS + w) * STEPS + s) * 8:((blk * WARPS + w) * STEPS + s) * 8 + 5]
                    print(f"  {s:4d} {w:4d}: " + " ".join(f"{v - t0:7d}" if v else "      -" for v in c))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("precisions", nargs="*", default=["tf32", "bf16", "fp16"],
                   help="x's type: tf32 (float32), bf16, fp16")
    p.add_argument("--steps", nargs=2, type=int, default=[10, 110], metavar=("FIRST", "LAST"))
    p.add_argument("--source", default=os.path.join(HERE, "model_new.py"), help="the model_new.py to stamp")
    args = p.parse_args()
    first, last = args.steps
    if not 0 <= first < last < min(STEPS, ROWS):
        p.error(f"--steps: expected 0 <= FIRST < LAST < {min(STEPS, ROWS)}, got {first} {last}")
    work = tempfile.mkdtemp(prefix="kb25_dw_timeline_")
    try:
        with open(args.source) as f:
            timeline.use_stamped_copy(stamped_source(f.read()), work)
        import torch
        import harness
        import model_new
        import reference

        torch.backends.cudnn.allow_tf32 = True
        full = (128, reference.in_channels, reference.height, reference.width)
        auto = model_new.OP_BACKENDS.index("auto")
        for name in args.precisions:
            dtype = {"tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
            _, new = harness.make_models(SEED, device="cuda")
            w, b = (t.detach().to(dtype) for t in (new.conv.weight, new.conv.bias))
            x = harness.make_input(full, seed=SEED + 6, device="cuda").to(dtype)
            with torch.no_grad():
                out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, auto)
                seed = torch.Generator("cuda").manual_seed(SEED + 7)
                g = torch.randn(out.shape, generator=seed, device="cuda").to(dtype)
                backward = getattr(torch.ops, model_new.OP_NAMESPACE).conv_min_tanh2_backward
                for _ in range(2):  # warm: the shared-memory opt-in, the caches
                    backward(g, x, w, argmin, pre_min, *harness.BACKWARD_PARTS["grad_weight"])
                torch.cuda.synchronize()
                if model_new._ext.timeline_stamp(-1) != 0:
                    raise RuntimeError("dw_timeline: could not clear the stamps")
                backward(g, x, w, argmin, pre_min, *harness.BACKWARD_PARTS["grad_weight"])
                torch.cuda.synchronize()
            stamp = [model_new._ext.timeline_stamp(i) for i in range(STAMP_COUNT)]  # i = 0 copies them out
            report(name, stamp, first, last)
            del x, out, argmin, pre_min, g
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
