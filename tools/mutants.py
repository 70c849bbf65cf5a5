"""Break the code on purpose and check that the tests notice. Each mutant is one textual edit of model_new.py,
built into its own extension cache; the tests named for it must fail on it (with an assertion, not an error).

    python3 tools/mutants.py                 # every mutant (needs a CUDA GPU: the mutations are in the kernels)
    python3 tools/mutants.py --only min_drops_nan rows_wrong_rotation

The CPU-side mutations (a wrong variant accepted by the checks, the exact-fp32 case) are covered by the CPU tests
themselves; these are the ones only a GPU can see.
"""
import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_FILES = ("model_new.py", "harness.py", "reference.py", "test_correctness.py", "pyproject.toml")
PROJECT_DIRS = ("tests", "tools")  # test_correctness.py collects tests/ and imports tools/machine_code.py



def node(test, key=None, shape=None):
    """A pytest node id of test_correctness.py from a test name, a case key of harness.CASES (checked to exist) and
    an edge shape's id."""
    if key is not None:
        sys.path.insert(0, HERE)
        import harness

        assert key in harness.CASES, f"no case {key!r} in harness.CASES"
    params = "-".join(p for p in (shape, key) if p)
    return f"{test}[{params}]" if params else test


# name -> (original text, mutated text, tests that must fail)
MUTANTS = {
    # TF32 on fp16 operands: no input is ever out of range, so nothing goes to the guard
    "carrier_guard_disabled": (
        "    return range | ((w & 0x7FFF7FFFu) + 0x04010401u);",
        "    return 0u * (range | w);",
        ["test_guard_lists_and_recomputes_inputs_fp16_does_not_hold[sm90_tf32_f16]",
         "test_guard_lists_and_recomputes_inputs_fp16_does_not_hold[sm80_tf32_f16]",
         "test_guard_runs_in_one_stream_under_cuda_graphs"],
    ),
    # the weights' scale stays in the output
    "carrier_scale_not_undone": (
        "__device__ static float unscale(float m, float inverse) { return m * inverse; }",
        "__device__ static float unscale(float m, float inverse) { return m; }",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_tf32_f16-tiny]",
         "test_tf32_on_fp16_operands_gives_the_tf32_products[sm80_tf32_f16-rand]"],
    ),
    # inputs rounded to nearest even instead of ties away
    "carrier_rounds_to_even": (
        'asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi | 1u)), "f"(__uint_as_float(lo | 1u)));',
        'asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));',
        ["test_tf32_on_fp16_operands_gives_the_tf32_products[sm90_tf32_f16-ties]",
         "test_tf32_on_fp16_operands_gives_the_tf32_products[sm80_tf32_f16-ties]"],
    ),
    # inputs below fp16's normal range flushed to zero
    "carrier_flushes_subnormals": (
        'asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi | 1u)), "f"(__uint_as_float(lo | 1u)));',
        'asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(fabsf(__uint_as_float(hi)) < 6.1035156e-5f ? 0.f : __uint_as_float(hi | 1u)), "f"(fabsf(__uint_as_float(lo)) < 6.1035156e-5f ? 0.f : __uint_as_float(lo | 1u)));',
        ["test_tf32_on_fp16_operands_gives_the_tf32_products[sm90_tf32_f16-subnormal]",
         "test_tf32_on_fp16_operands_gives_the_tf32_products[sm80_tf32_f16-subnormal]"],
    ),
    # autocast's kernels truncate x to bf16 instead of rounding it to nearest even as .to() does
    "cast_input_truncates": (
        'asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));',
        'asm("cvt.rz.bf16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));',
        ["test_cast_input_kernel_equals_the_16bit_kernel_on_the_cast_input[sm90_bf16_from_fp32-ties]",
         "test_cast_input_kernel_equals_the_16bit_kernel_on_the_cast_input[sm80_bf16_from_fp32-ties]"],
    ),
    # strict fp32's saved minima kept as the 3xTF32 tensor cores summed them (not recomputed in float64)
    "strict_minima_not_refined": (
        "if (save && kb25::kFusedKernelPrecision[kernel] == kb25::kPrecisionStrictFp32) {",
        "if (false && save && kb25::kFusedKernelPrecision[kernel] == kb25::kPrecisionStrictFp32) {",
        ["test_strict_saving_forward_minima_are_fp32_roundings[H100]",
         "test_strict_saving_forward_minima_are_fp32_roundings[A100]"],
    ),
    # autocast's kernels truncate the float32 weights and bias instead of rounding them to nearest even
    "cast_weights_truncate": (
        "__device__ static Elem_ param(float v) { return convert<Elem_>(v); }",
        "__device__ static Elem_ param(float v) { return convert<Elem_>(__uint_as_float(__float_as_uint(v) & 0xFFFF0000u)); }",
        ["test_autocast_kernel_rounds_the_weights_as_the_cast[torch.bfloat16-H100-ties]",
         "test_autocast_kernel_rounds_the_weights_as_the_cast[torch.float16-A100-ties]"],
    ),
    # the carrier keeps images whose weights hold an infinity (fp16 carries it; what it meets, it does not)
    "carrier_keeps_infinite_weights": (
        "return !(isfinite(tf32) && scaled * __frcp_rn(scale) == tf32 &&",
        "return !(scaled * __frcp_rn(scale) == tf32 &&",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_tf32_f16-inf_weight]",
         "test_weight_scale_carries_weights_or_lists_every_image[sm80_tf32_f16-inf_weight]",
         node("test_an_infinite_weight_beside_zero_weights_gives_torch_mins", shape="H100-inf")],
    ),
    # the carrier keeps images with a finite weight that TF32 rounds up to infinity (checks v, not its TF32 value)
    "carrier_keeps_tf32_overflow_weights": (
        "return !(isfinite(tf32) && scaled * __frcp_rn(scale) == tf32 &&",
        "return !(isfinite(v) && scaled * __frcp_rn(scale) == tf32 &&",
        [node("test_an_infinite_weight_beside_zero_weights_gives_torch_mins", shape="H100-tf32_overflow"),
         node("test_an_infinite_weight_beside_zero_weights_gives_torch_mins", shape="A100-tf32_overflow")],
    ),
    # the eager step's recomputed backward takes an unbatched input's min over the channels, not the rows
    "saving_step_unbatched_min_over_channels": (
        "const int64_t dim = batched ? 1 : 2;",
        "const int64_t dim = 1;",
        ["test_eager_step_that_saves_nothing_follows_the_reference[unbatched]"],
    ),
    # the C++ reference chain's backward takes the inner tanh's derivative twice, the outer one never
    "reference_backward_inner_tanh_twice": (
        "at::tanh_backward(at::tanh_backward(grad4, t2), t1);",
        "at::tanh_backward(at::tanh_backward(grad4, t1), t1);",
        ["test_eager_step_that_saves_nothing_follows_the_reference[float64]",
         "test_eager_step_that_saves_nothing_follows_the_reference[unbatched]",
         "test_training_double_backward_follows_the_reference[True]"],
    ),
    # the carrier keeps images where the bias holds an infinity
    "carrier_keeps_an_infinite_bias": (
        "return !(isfinite(v) && scaled * __frcp_rn(scale) == v && sum == scaled);",
        "return !(scaled * __frcp_rn(scale) == v && sum == scaled);",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_tf32_f16-inf_bias]",
         "test_weight_scale_carries_weights_or_lists_every_image[sm80_tf32_f16-inf_bias]"],
    ),
    # the carrier's bias MMA loses the bias's second part (B's k row 1 zero instead of 2^-11)
    "carrier_bias_part_dropped": (
        "return __float2half_rn(kk == 1 ? 0x1p-11f : kk == 2 ? 0x1p-22f : 1.f);",
        "return __float2half_rn(kk == 1 ? 0.f : kk == 2 ? 0x1p-22f : 1.f);",
        ["test_tf32_on_fp16_operands_gives_the_tf32_products[sm90_tf32_f16-rand]"],
    ),
    # fminf drops NaN: min(NaN, x) = x
    "min_drops_nan": (
        'asm("min.NaN.f32 %0, %1, %2;\\n" : "=f"(r) : "f"(a), "f"(b));',
        "r = fminf(a, b);",
        [node("test_nan_wins_over_inf_channels_in_the_min", "fused-tf32"),
         node("test_nan_wins_over_inf_channels_in_the_min", "kernel-sm80_bf16")],
    ),
    # operands reach the tensor cores unrounded, which then use their top 19 bits: truncated TF32
    "no_tf32_rounding": (
        'asm("cvt.rna.tf32.f32 %0, %1;\\n" : "=r"(r) : "f"(v));',
        "r = __float_as_uint(v);",
        ["test_full_size_matches_reference[0]"],
    ),
    # TF32 rounding as an integer add and mask: right for every number, but a NaN with every bit set carries out to
    # a zero (the wgmma TF32 inputs, every kernel's weights)
    "tf32_rounding_wraps_nan": (
        'asm("cvt.rna.tf32.f32 %0, %1;\\n" : "=r"(r) : "f"(v));',
        "r = (__float_as_uint(v) + 0x1000u) & 0xFFFFE000u;",
        [node("test_nan_and_inf_inputs", "fused-tf32", shape="by_element"),
         node("test_nan_and_inf_inputs", "kernel-sm90_tf32", shape="by_element")],
    ),
    # NaNs reach the TF32 rounding as they come: one whose payload is only in the 13 low bits reads as infinity
    "nan_not_canonical": (
        "__device__ __forceinline__ float canonical_nan(float v) { return nan_min(v, __int_as_float(0x7F800000)); }",
        "__device__ __forceinline__ float canonical_nan(float v) { return v; }",
        [node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm90_tf32", shape="input"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "fused-tf32", shape="weight"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm80_tf32", shape="input"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm80_tf32_99k", shape="input")],
    ),
    # mma.sync TF32 inputs reach the tensor cores unrounded: truncated TF32
    "mma_sync_no_tf32_rounding": (
        "out[i] = kClear ? (v[i] + 0x1000u) & 0xFFFFE000u : v[i] + 0x1000u;",
        "out[i] = kClear ? (v[i] + 0x1000u) & 0xFFFFE000u : v[i];",
        [node("test_device_profiles_choose_and_compute_right", shape="A100"),
         node("test_device_profiles_choose_and_compute_right", shape="A10G")],
    ),
    # rows with a NaN take the fast rounding too: a NaN with every bit set carries out to a zero, one with its payload
    # only in the low bits reads as infinity
    "nan_rows_take_the_fast_rounding": (
        "for (int c = 0; c < kChannels; ++c) nan |= either_nan(raw[c].x, raw[c].y) | either_nan(raw[c].z, raw[c].w);",
        "for (int c = 0; c < kChannels; ++c) nan |= false;",
        [node("test_nan_and_inf_inputs", "kernel-sm80_tf32", shape="aligned"),
         node("test_nan_and_inf_inputs", "kernel-sm80_tf32_99k", shape="aligned"),
         node("test_nan_and_inf_inputs", "kernel-sm90_tf32", shape="aligned"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "fused-tf32", shape="input")],
    ),
    # the TF32 carrier rounds by adding half a TF32 unit and truncating: a NaN with every bit set carries out to a zero,
    # which lists nothing
    "carrier_nan_carries_out": (
        'asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi | 1u)), "f"(__uint_as_float(lo | 1u)));',
        'asm("cvt.rz.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(__uint_as_float(hi + 0x1000u)), "f"(__uint_as_float(lo + 0x1000u)));',
        [node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm90_tf32_f16", shape="all_bits"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm80_tf32_f16", shape="all_bits"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "fused-tf32", shape="all_bits_by_element"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm90_tf32_f16", shape="all_bits_by_element"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm80_tf32_f16", shape="all_bits_by_element")],
    ),
    # the late item (the chunk past a 256-column tile) skips the NaN check: its NaNs take the fast rounding
    "late_item_skips_the_nan_check": (
        "store_item(quieted(raw), kBody + tid, slot, range);",
        "store_item(raw, kBody + tid, slot, range);",
        [node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm90_tf32", shape="late_item"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm80_tf32", shape="late_item")],
    ),
    # the NaN check reads one word of each pair: NaNs in the other half of the words take the fast rounding
    "nan_check_misses_every_other_word": (
        'asm("{\\n .reg .pred p;\\n setp.nan.f32 p, %1, %2;',
        'asm("{\\n .reg .pred p;\\n setp.nan.f32 p, %1, %1;',
        [node("test_nan_and_inf_inputs", "kernel-sm80_tf32", shape="aligned"),
         node("test_nan_and_inf_inputs", "kernel-sm90_tf32", shape="aligned"),
         node("test_nan_with_only_low_payload_bits_stays_nan", "kernel-sm90_tf32", shape="input")],
    ),
    # pack2 takes its halves the wrong way round: the 16-bit wgmma reduce packs each pixel pair (2i, 2i + 1) swapped,
    # and the write, which stores its pixels one at a time, puts each one's result in the other's place
    "packed_min_pairs_swapped": (
        '''    if constexpr (kHasFused && kBf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(hi), "f"(lo));
    if constexpr (kHasFused && !kBf16) asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(hi), "f"(lo));''',
        '''    if constexpr (kHasFused && kBf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(lo), "f"(hi));
    if constexpr (kHasFused && !kBf16) asm("cvt.rn.f16x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(lo), "f"(hi));''',
        [node("test_edge_shapes", "kernel-sm90_bf16", shape="2x16x67x67"),
         node("test_edge_shapes", "kernel-sm90_fp16", shape="2x16x67x67")],
    ),
    # the 16-bit packed min (the reduce's lane fold and the write's, over the staged minima) drops NaN (min instead of
    # min.NaN)
    "packed_min_drops_nan": (
        '''    if constexpr (kHasFused && kBf16) asm("min.NaN.bf16x2 %0, %1, %2;\\n" : "=r"(r) : "r"(a), "r"(b));
    if constexpr (kHasFused && !kBf16) asm("min.NaN.f16x2 %0, %1, %2;\\n" : "=r"(r) : "r"(a), "r"(b));''',
        '''    if constexpr (kHasFused && kBf16) asm("min.bf16x2 %0, %1, %2;\\n" : "=r"(r) : "r"(a), "r"(b));
    if constexpr (kHasFused && !kBf16) asm("min.f16x2 %0, %1, %2;\\n" : "=r"(r) : "r"(a), "r"(b));''',
        [node("test_nan_wins_over_inf_channels_in_the_min", "fused-bf16"),
         node("test_nan_and_inf_inputs", "kernel-sm90_fp16", shape="aligned")],
    ),
    # the first tanh of a 16-bit output rounded to bf16 before the second (the reference rounds there): over one ulp
    # of the exact tanh(tanh(m)) for some 16-bit m
    "tanh2_rounds_between": (
        'asm("tanh.approx.f32 %0, %0;\\n tanh.approx.f32 %0, %0;\\n" : "+f"(v));',
        'asm("tanh.approx.f32 %0, %0;\\n" : "+f"(v)); v = __bfloat162float(__float2bfloat16(v));\n'
        '    asm("tanh.approx.f32 %0, %0;\\n" : "+f"(v));',
        [node("test_16bit_tanh2_of_every_value", "kernel-sm90_bf16"),
         node("test_16bit_tanh2_of_every_value", "kernel-sm80_bf16")],
    ),
    # the SFU's tanh for 3xTF32 too: its error is many times what strict fp32 is allowed
    "tanh2_approx_for_strict": (
        "  static constexpr bool kTanhApprox = false;  // tanh2: 1e-5 against the strict reference\n",
        "  static constexpr bool kTanhApprox = true;\n",
        [node("test_fp32_tanh2_error", "kernel-sm90_tf32x3"), node("test_fp32_tanh2_error", "kernel-sm80_tf32x3"),
         "test_other_precisions_full_size[strict_fp32]"],
    ),
    # the SFU's tanh for TF32 too (within TF32's 1e-4, but not what the fp32 paths promise)
    "tanh2_approx_for_tf32": (
        "  static constexpr bool kTanhApprox = false;\n",
        "  static constexpr bool kTanhApprox = true;\n",
        [node("test_fp32_tanh2_error", "kernel-sm90_tf32"), node("test_fp32_tanh2_error", "kernel-sm80_tf32")],
    ),
    # the saving 16-bit wgmma forward takes tanh of its unrounded min: its output is no longer the inference one's
    "saving_forward_keeps_the_unrounded_min": (
        "    if constexpr (kStagesPacked) m = convert<float>(convert<Elem>(m));\n",
        "",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # strict fp32 without the small products: plain TF32 (big * big), ~1e-4 from the strict reference
    "strict_drops_small_products": (
        """    wgmma_async(small, a + a_small, b, Operand<Elem>{});
    wgmma_async(small, a, b + b_small, Operand<Elem>{});""",
        "",
        ["test_other_precisions_full_size[strict_fp32]", node("test_edge_shapes", "kernel-sm90_tf32x3", "2x16x67x67")],
    ),
    # strict fp32 on fp16 parts: no input is ever listed, so infinities, NaN and values beyond fp16 take the fp16 path
    "strict_f16_guard_disabled": (
        "    return m >= 0x7BFFu || (m != 0 && m <= 0x0400u);",
        "    return 0u * m != 0u;",
        ["test_guard_lists_and_recomputes_inputs_fp16_does_not_hold[sm90_f16x3]",
         "test_strict_on_fp16_parts_gives_fp32_products[sm90_f16x3-subnormal]"],
    ),
    # strict fp32 on fp16 parts: inputs all below fp16's normal range are not listed (their 2^-36 steps stay)
    "strict_f16_keeps_subnormal_rows": (
        "    return m >= 0x7BFFu || (m != 0 && m <= 0x0400u);",
        "    return m >= 0x7BFFu;",
        ["test_strict_on_fp16_parts_gives_fp32_products[sm90_f16x3-subnormal]"],
    ),
    # strict fp32 on fp16 parts: the lo parts' 2^11 is not undone (their products count 2048 times)
    "strict_f16_small_not_unscaled": (
        "      return v * (kSmallExp < 0 ? 1.f / (float)(1 << -kSmallExp) : (float)(1 << kSmallExp));",
        "      return v;",
        ["test_strict_on_fp16_parts_gives_fp32_products[sm90_f16x3-rand]",
         node("test_edge_shapes", "kernel-sm90_f16x3", "2x16x67x67")],
    ),
    # strict fp32 on fp16 parts: the lo words are not folded into the range, so values all below 2^-25 (hi 0) stay
    "strict_f16_dust_not_listed": (
        "            range = Precision::range_fold(range, q[col][k], 0u, 0u);  // lo: nonzero where hi rounded a value to 0\n",
        "",
        ["test_strict_on_fp16_parts_gives_fp32_products[sm90_f16x3-dust]"],
    ),
    # strict fp32 on fp16 parts: a bias the scale takes below fp32's normal range is kept, its bits lost
    "strict_f16_keeps_a_lost_bias": (
        "return !isfinite(v) || (v * scale) * __frcp_rn(scale) != v; }",
        "return !isfinite(v); }",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_f16x3-bias_lost]"],
    ),
    # strict fp32 on fp16 parts, mma.sync: the lo fragment loaded from the hi copy (hi * hi counted three times)
    "strict_f16_mma_sync_lo_from_hi": (
        "ldmatrix_x4(as[mt], a_addr + mt * 16 * 16 + Geometry::kCopyBytes);",
        "ldmatrix_x4(as[mt], a_addr + mt * 16 * 16);",
        ["test_strict_on_fp16_parts_gives_fp32_products[sm80_f16x3-rand]",
         node("test_edge_shapes", "kernel-sm80_f16x3", "2x16x67x67")],
    ),
    # strict fp32 on fp16 parts: the weights' scale stays in the output
    "strict_f16_scale_not_undone": (
        "__device__ static float unscale(float m, float inverse_scale) { return m * inverse_scale; }",
        "__device__ static float unscale(float m, float inverse_scale) { return m; }",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_f16x3-tiny]",
         "test_strict_on_fp16_parts_gives_fp32_products[sm90_f16x3-rand]"],
    ),
    # strict fp32 on fp16 parts: weights far below the largest are carried as fp16 subnormals, not listed
    "strict_f16_keeps_weights_it_cannot_carry": (
        "return !isfinite(v) || (v != 0.f && fabsf(v * scale) < 0x1p-14f); }",
        "return !isfinite(v); }",
        ["test_weight_scale_carries_weights_or_lists_every_image[sm90_f16x3-wide]"],
    ),
    # the 16-bit transpose writes the two columns of a pair swapped: every bf16/fp16 pixel pair comes out exchanged
    "transpose_swaps_columns": (
        "const uint32_t sel_even = (x & 1) ? 0x7632 : 0x5410,",
        "const uint32_t sel_even = (x & 1) ? 0x5410 : 0x7632,",
        ["test_other_precisions_full_size[bf16]", "test_other_precisions_full_size[fp16]"],
    ),
    # the fp32 producer rotates each column's values but writes them to the unrotated place
    "column_rotation_mismatch": (
        "store_column(dst + ((jj + r) & 3) * 16,",
        "store_column(dst + jj * 16,",
        ["test_full_size_matches_reference[0]", "test_other_precisions_full_size[strict_fp32]"],
    ),
    # the 16-bit producer writes column jj ^ x's values to column jj: the swizzle applied to the data only
    "swizzle_mismatch": (
        "store_column(dst + (jj ^ x) * 16,",
        "store_column(dst + jj * 16,",
        ["test_other_precisions_full_size[bf16]", "test_other_precisions_full_size[fp16]"],
    ),
    # the element-by-element loads (W not a multiple of the vector width) read one channel for all of a group's
    "element_loads_miss_the_channel_stride": (
        """      for (int c = 0; c < kChannels; ++c, src += plane) {
#pragma unroll""",
        """      for (int c = 0; c < kChannels; ++c) {
#pragma unroll""",
        [node("test_edge_shapes", "fused-tf32", "2x16x67x67"), node("test_edge_shapes", "fused-bf16", "2x16x67x67")],
    ),
    # the producer never loads the late items (each group's last chunk): in a row wider than the tile, the tile's
    # last two pixels read stale columns
    "late_items_never_loaded": (
        "if (tid < kLate && reaches_late(col0)) {",
        "if (false) {",
        [node("test_edge_shapes", "fused-tf32", "3x16x40x600"), node("test_edge_shapes", "fused-bf16", "3x16x40x600"),
         node("test_edge_shapes", "kernel-sm80_tf32", "3x16x40x600")],
    ),
    # self-fed consumers store the next row over the window's middle row, which the step's later taps still read
    "self_fed_row_over_the_window": (
        "      stored(producer.store(next, slot(rows), x_img, min(at.oy + kK, H - 1), col0), at);",
        "      stored(producer.store(next, slot(rows + 1), x_img, min(at.oy + kK, H - 1), col0), at);",
        [node("test_edge_shapes", "kernel-sm80_tf32", "3x16x40x600"), "test_other_precisions_full_size[strict_fp32]"],
    ),
    # self-fed consumers, element path (W not a multiple of the vector width): the step's new row is the one before
    "self_fed_element_path_takes_the_wrong_row": (
        "      stored(producer.copy_by_element(x_img, at.oy + kK, col0, slot(rows)), at);",
        "      stored(producer.copy_by_element(x_img, at.oy + kK - 1, col0, slot(rows)), at);",
        [node("test_edge_shapes", "kernel-sm80_tf32", "2x16x301x19"),
         node("test_edge_shapes", "kernel-sm80_tf32x3", "2x16x301x19"),
         node("test_edge_shapes", "kernel-sm80_tf32", "64x16x20x19")],
    ),
    # the fp32 epilogue's last butterfly step is skipped: each pixel's min covers half of every warp's channels
    "epilogue_skips_a_fold": (
        "fold<kNBlocks / 4>(v, ch, (g >> 2) & 1, 16);",
        "",
        ["test_full_size_matches_reference[0]"],
    ),
    # a consumer never writes the last step of its range (its write waits for a next step that never comes)
    "last_step_never_written": (
        "      if (begin < end) epilogue.write(pending, row_out(pending_row), pending_col0, OW);\n",
        "",
        [node("test_edge_shapes", "kernel-sm90_tf32x3", "2x16x67x67"), node("test_edge_shapes", "kernel-sm90_tf32", "2x16x67x67")],
    ),
    # wgmma 16-bit and TF32 on fp16, the write handed to the producer threads: the steps still staged after their last
    # row (the last kLag of each consumer's range) are never written
    "handed_last_steps_never_written": (
        "    while (epilogue.staged < steps) write();\n",
        "",
        [node("test_edge_shapes", "kernel-sm90_bf16", "2x16x67x67"), node("test_edge_shapes", "kernel-sm90_fp16", "3x16x40x600"),
         node("test_edge_shapes", "kernel-sm90_tf32_f16", "2x16x67x67")],
    ),
    # the handed fp32 minima (TF32 on fp16 operands): the producer threads write only each step's first 128 pixels
    # (shapes of at most 130 columns do not see it)
    "handed_fp32_half_the_pixels": (
        "      for (int p = ptid; p < kTileCols; p += kApart) {\n        const int col = col0 + p;\n        if (col < OW) dst.out",
        "      for (int p = ptid; p < kTileCols / 2; p += kApart) {\n        const int col = col0 + p;\n        if (col < OW) dst.out",
        ["test_full_size_matches_reference[0]", node("test_edge_shapes", "kernel-sm90_tf32_f16", "3x16x40x600")],
    ),
    # after a column block's last row a consumer (and its producer) goes on in the next image, not the next block
    "next_block_skipped_for_the_next_image": (
        "      oy = 0;\n      if (++cb == col_blocks) {\n",
        "      oy = 0;\n      if (++cb <= col_blocks) {\n",
        [node("test_edge_shapes", "kernel-sm90_bf16", "5x16x40x600"),
         node("test_edge_shapes", "kernel-sm90_tf32", "5x16x40x600")],
    ),
    # a self-fed consumer never writes the last step of its range
    "self_fed_last_step_never_written": (
        "  if (steps > 0) epilogue.write(pending, row_out(pending_row), pending_col0, OW);\n",
        "",
        [node("test_edge_shapes", "kernel-sm80_tf32", "3x16x40x600"),
         node("test_edge_shapes", "kernel-sm80_tf32x3", "3x16x40x600")],
    ),
    # a self-fed consumer's deferred write lands in the current step's row instead of the previous step's
    "self_fed_write_goes_to_the_current_row": (
        "if (i != 0) epilogue.write(pending, row_out(pending_row), pending_col0, OW);",
        "if (i != 0) epilogue.write(pending, row_out((at.n * OH + at.oy) * (int64_t)OW), col0, OW);",
        [node("test_edge_shapes", "kernel-sm80_tf32", "3x16x40x600"), "test_other_precisions_full_size[strict_fp32]"],
    ),
    # the deferred write lands in the current step's row instead of the previous step's
    "write_goes_to_the_current_row": (
        "if (s != begin) epilogue.write(pending, row_out(pending_row), pending_col0, OW);",
        "if (s != begin) epilogue.write(pending, row_out((at.n * OH + at.oy) * (int64_t)OW), col0, OW);",
        ["test_full_size_matches_reference[0]"],
    ),
    # a weight that TF32 holds exactly keeps a zero small part: 0 * inf = NaN where the reference has an infinity
    "strict_inf_times_zero": (
        """  } else if (small == 0.f && big != 0.f) {
    small = copysignf(1.17549435e-38f, big);
  }""",
        "  }",
        [node("test_strict_fp32_infinite_input_with_tf32_exact_weights", "fused-strict_fp32"),
         node("test_strict_fp32_infinite_input_with_tf32_exact_weights", "kernel-sm80_tf32x3")],
    ),
    # an infinite weight stays in its big part: small(x) * inf = 0 * inf = NaN for every TF32-exact input
    "strict_infinite_weight_in_big": (
        """  if (isinf(v)) {
    big = copysignf(__uint_as_float(0x7F7FE000u), v);
    small = v;
  } else if""",
        "  if (false) {\n  } else if",
        [node("test_strict_fp32_infinite_weight_with_tf32_exact_inputs", "fused-strict_fp32"),
         node("test_strict_fp32_infinite_weight_with_tf32_exact_inputs", "kernel-sm80_tf32x3")],
    ),
    # mma.sync's ldmatrix rows: lanes 8-15 address the next channel group instead of pixels 8-15
    "ldmatrix_rows_mixed_up": (
        "const uint32_t lane_offset = (lane >> 4) * Geometry::kGroupBytes + (warp_col + (lane & 15)) * 16;",
        "const uint32_t lane_offset = ((lane >> 3) & 1) * Geometry::kGroupBytes + (warp_col + (lane & 7) + (lane >> 4) * 8) * 16;",
        [node("test_edge_shapes", "kernel-sm80_tf32", "2x16x67x67"), node("test_edge_shapes", "kernel-sm80_bf16", "2x16x67x67")],
    ),
    # the 16-bit weight fragments take their k-halves 2 elements apart instead of kMmaK / 2
    "weight_fragment_k_half": (
        "Geometry::kMmaK / 2 * (e & 1) + h;",
        "kPerWord * (e & 1) + h;",
        [node("test_edge_shapes", "kernel-sm80_bf16", "2x16x67x67"), node("test_edge_shapes", "kernel-sm80_tf32", "2x16x67x67")],
    ),
    # mma.sync's first MMA starts from zero instead of the bias fragment: no bias in any channel
    "mma_sync_bias_dropped": (
        "      mma_sync(acc, a, bw[0], bw[1], bias, Operand<Elem>{});",
        "      mma_sync(acc, a, bw[0], bw[1], float4{0.f, 0.f, 0.f, 0.f}, Operand<Elem>{});",
        [node("test_edge_shapes", "kernel-sm80_tf32", "2x16x67x67"), node("test_edge_shapes", "kernel-sm80_bf16", "2x16x67x67"),
         node("test_edge_shapes", "kernel-sm80_tf32x3", "2x16x67x67")],
    ),
    # wgmma 16-bit: the bias k-step never issued (no bias in any channel)
    "wgmma_bias_step_dropped": (
        "        wgmma_async(acc, bias, weights + kOnes, Operand<MmaElem>{});\n",
        "",
        [node("test_edge_shapes", "kernel-sm90_bf16", "2x16x67x67"), node("test_edge_shapes", "kernel-sm90_fp16", "2x16x67x67")],
    ),
    # wgmma 16-bit: the bias k-step's A holds the bias in every k column, so each channel gets its bias 16 times
    "wgmma_bias_in_every_k_column": (
        "      return kk == 0 ? bias : convert<M>(0.f);",
        "      return bias;",
        [node("test_edge_shapes", "kernel-sm90_bf16", "2x16x67x67"), node("test_edge_shapes", "kernel-sm90_fp16", "2x16x67x67")],
    ),
    # wgmma 16-bit, the paired write: the pair's second pixel (kWarpgroup columns on) is never stored
    "pair_write_drops_second_pixel": (
        "    if (col + Geometry::kWarpgroup < OW)\n",
        "    if (col + Geometry::kWarpgroup < 0)\n",
        [node("test_edge_shapes", "kernel-sm90_bf16", "2x16x255x255"), node("test_edge_shapes", "kernel-sm90_fp16", "3x16x40x600")],
    ),
    # wgmma 16-bit, the paired write: the last word of the second and fourth chunks dropped (lane groups 6 and 7 of
    # two of the four warps: 8 of the 64 channels never win)
    "pair_write_skips_lane_groups": (
        "      x[k].w = Precision::min2(x[k].w, x[k + 1].w);\n",
        "",
        [node("test_edge_shapes", "kernel-sm90_bf16", "2x16x67x67"), node("test_other_precisions_full_size", shape="bf16")],
    ),
    # wgmma: the window's newest row never waited for: the MMAs of taps 6-8 may read its slot before the producer
    # has stored it (at least at each consumer's first step, whose three rows the producer has only begun)
    "newest_row_not_waited": (
        "        wait_newest();\n        wgmma_fence();\n",
        "        wgmma_fence();\n",
        [node("test_full_size_matches_reference", shape="0"), node("test_other_precisions_full_size", shape="bf16")],
    ),
    # wgmma 16-bit, the lane fold before staging: even lane groups keep the upper half of the blocks, so the staged
    # words carry each pixel's minima in the other pixel's half (pixels p and p + 128 swapped)
    "fold_halves_swapped": (
        "      const bool upper = g & 1;\n",
        "      const bool upper = !(g & 1);\n",
        [node("test_edge_shapes", "kernel-sm90_fp16", "2x16x67x67"), node("test_other_precisions_full_size", shape="fp16")],
    ),
    # wgmma TF32: the bias k-step without the TF32 bias's second and third parts: the bias truncated to TF32
    "wgmma_tf32_bias_truncated": (
        "  const float rest = isfinite(v) ? v - part[0] : 0.f;",
        "  const float rest = 0.f;",
        [node("test_bias_enters_as_the_fp32_value", "kernel-sm90_tf32", "beyond_tf32"),
         node("test_bias_enters_as_the_fp32_value", "fused-tf32", "beyond_tf32")],
    ),
    # wgmma TF32: the bias's first part rounded to nearest: the largest floats become infinite, the rest inf - inf
    "wgmma_tf32_bias_part_rounds_up": (
        "  part[0] = (v == v) ? of(bits(v) & 0xFFFFE000u) : of(0x7FFFFFFFu);",
        "  part[0] = (v == v) ? of((bits(v) + 0x1000u) & 0xFFFFE000u) : of(0x7FFFFFFFu);",
        [node("test_bias_enters_as_the_fp32_value", "kernel-sm90_tf32", "largest")],
    ),
    # wgmma TF32: a NaN bias truncated as it comes: one with payload only in the 13 low bits becomes infinity
    "wgmma_tf32_bias_nan_not_canonical": (
        "  part[0] = (v == v) ? of(bits(v) & 0xFFFFE000u) : of(0x7FFFFFFFu);",
        "  part[0] = of(bits(v) & 0xFFFFE000u);",
        [node("test_bias_enters_as_the_fp32_value", "kernel-sm90_tf32", "nan_low_payload")],
    ),
    # the bias fragments hold channel 2t's bias in both columns: channel 2t + 1 gets its neighbour's
    "mma_sync_bias_fragment_columns": (
        "bdst[i] = Precision::scale(convert<float>(Precision::param(b[i / 4 * 2 + (i & 1)])), scale);",
        "bdst[i] = Precision::scale(convert<float>(Precision::param(b[i / 4 * 2])), scale);",
        [node("test_edge_shapes", "kernel-sm80_tf32", "2x16x67x67"), node("test_edge_shapes", "kernel-sm80_fp16", "2x16x67x67")],
    ),
    # mma.sync 3xTF32 without the big(w) * small(x) product
    "mma_sync_strict_drops_a_small_product": (
        "    mma_sync(small, as, bw[0], bw[1], Operand<Elem>{});\n",
        "",
        [node("test_edge_shapes", "kernel-sm80_f16x3", "2x16x67x67"),
         node("test_edge_shapes", "kernel-sm80_tf32x3", "2x16x67x67")],
    ),
    # each lane of a quad stores m-tile 0 (of every 4) only: the other m-tiles' pixels are never written
    "mma_sync_epilogue_stores_one_tile": (
        "const int mt = t + 4 * i;",
        "const int mt = 4 * i;",
        [node("test_edge_shapes", "kernel-sm80_tf32", "2x16x67x67"), node("test_edge_shapes", "kernel-sm80_fp16", "2x16x67x67")],
    ),
    # the chooser ignores shared memory: a 99 KB GPU gets a kernel that asks for more
    "chooser_ignores_shared_memory": (
        "return device.sm >= r.min_sm && r.smem_bytes <= device.smem_optin;",
        "return device.sm >= r.min_sm;",
        [node("test_device_profiles_choose_and_compute_right", shape="A10G"),
         "test_chooser_picks_only_kernels_each_arch_can_launch"],
    ),
    # emulate_device sets a profile that nothing reads
    "emulation_ignored": (
        "    if (emulating.load(std::memory_order_relaxed)) return emulated;\n",
        "",
        [node("test_device_profiles_choose_and_compute_right", shape="T4"),
         "test_emulate_device_nests_restores_and_refuses_what_cannot_launch"],
    ),
    # the backward: dX gathers the gradient of the mirrored neighbour (q + j instead of q - j)
    "grad_input_wrong_neighbour": (
        "const float2 v = tile[G::slot(y - i) * G::kTileCols + threadIdx.x + (G::kKsize - 1) - j];",
        "const float2 v = tile[G::slot(y - i) * G::kTileCols + threadIdx.x + j];",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100"),
         node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-T4")],
    ),
    # dX's taps outside the output read channel 0's weight row instead of the zero row
    "grad_input_outside_reads_channel_0": (
        "const float4* const row = ws + (tap * G::kWeightRows + k) * 4;",
        "const float4* const row = ws + (tap * G::kWeightRows + (k & 63)) * 4;",
        [node("test_grad_input_tap_outside_the_output_adds_nothing", shape="saving_forward-tf32")],
    ),
    # dX keeps its ring of output rows across a strip's start: the new strip's first rows read the last strip's
    "grad_input_strip_start_keeps_the_ring": (
        "if (s == begin || y == 0) {  // a strip's first step here",
        "if (s == begin) {  // a strip's first step here",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-H100-tf32")],
    ),
    # ties go to the last channel instead of torch.min's first
    "ties_go_to_the_last_channel": (
        "return a < b || (a == b && ia < ib);",
        "return a < b || (a == b && ia > ib);",
        [node("test_training_ties_go_to_the_first_channel", shape="H100"),
         node("test_training_ties_go_to_the_first_channel", shape="A100"),
         "test_argmin_order_is_torch_mins_in_any_fold_order"],
    ),
    # dW drops the last pixels of every k's run (those after the last group of four)
    "grad_weight_drops_run_tails": (
        "        for (; at < to; ++at) {\n          const int2 item = list[at];",
        "        for (; at < to && false; ++at) {\n          const int2 item = list[at];",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-A100")],
    ),
    # the tensor-core dW's operand scale keeps its old lower clamp: a largest |g| above 2^116 overflows fp16
    "grad_scale_clamped_at_minus_100": (
        "return max(-126, min(126, 141 - max((int)(largest >> 23), 1)));",
        "return max(-100, min(126, 141 - max((int)(largest >> 23), 1)));",
        ["test_training_weight_gradient_scales_with_the_output_gradient[tf32-H100]"],
    ),
    # the operand scale's upper clamp at 127, where 2^-127 (pow2) is 0: a largest |g| below 2^-112 gives dW = 0
    "grad_scale_clamped_at_127": (
        "return max(-126, min(126, 141 - max((int)(largest >> 23), 1)));",
        "return max(-126, min(127, 141 - max((int)(largest >> 23), 1)));",
        ["test_training_weight_gradient_scales_with_the_output_gradient[tf32-H100]"],
    ),
    # the fed dW leaves its sums at the fp16 operands' scale
    "grad_weight_fed_scale_not_undone": (
        "const float down = GradScale::pow2(-*reinterpret_cast<const int*>(newest + G::kScaleOffset));",
        "const float down = 1.f;",
        ["test_training_weight_gradient_scales_with_the_output_gradient[tf32-H100]",
         "test_training_weight_gradient_scales_with_the_output_gradient[bf16-H100]"],
    ),
    # the fed dW carries bf16 x into its fp16 slots with each word's high value replaced by its low one
    "grad_weight_fed_refits_the_low_bf16_twice": (
        "if constexpr (kBf16X) return pack2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));",
        "if constexpr (kBf16X) return pack2(__uint_as_float(w << 16), __uint_as_float(w << 16));",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW of 16-bit x folds only the low value of each word into its row's largest |x|: a NaN or an infinity in
    # an odd column is multiplied (0 * NaN on the tensor cores) instead of walked
    "grad_weight_fed_folds_half_the_16bit_words": (
        "__device__ static uint32_t fold2(uint32_t range, uint32_t w) { return __vmaxu2(range, w & 0x7FFF7FFFu); }",
        "__device__ static uint32_t fold2(uint32_t range, uint32_t w) { return __vmaxu2(range, w & 0x7FFFu); }",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-H100-fp16"),
         node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-A100-fp16")],
    ),
    # the fed dW's bias drops what the fp16 hi part leaves of gm (db keeps 11 bits a term)
    "grad_weight_fed_bias_drops_lo": (
        "const uint32_t a[4] = {G::kOnes, G::kOnes, G::kSmall, G::kSmall};",
        "const uint32_t a[4] = {G::kOnes, G::kOnes, 0u, 0u};",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW multiplies only the taps j = 0, 1 of its row
    "grad_weight_fed_drops_a_tap": (
        "for (int j = 0; j < G::kKsize; ++j) mma_sync(into[j], xa[j], b0, b1, Operand<__half>{});",
        "for (int j = 0; j < G::kKsize - 1; ++j) mma_sync(into[j], xa[j], b0, b1, Operand<__half>{});",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-A100")],
    ),
    # the fed dW's staged producer never copies the late vectors: the tile's last columns keep what the stage held
    "grad_weight_fed_stage_skips_late_vectors": (
        "if (late_lane && producer.reaches_late(f.col0)) {\n            cp_async16(",
        "if (false) {\n            cp_async16(",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's odd chunks' accumulators never join the sums
    "grad_weight_fed_drops_the_odd_chunks": (
        "for (int j = 0; j < G::kKsize; ++j) add[j] = acc[0][j][r] + acc[1][j][r];",
        "for (int j = 0; j < G::kKsize; ++j) add[j] = acc[0][j][r];",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's rank-0 sums held in registers never reach the CTA's sums after the last step
    "grad_weight_fed_carry_left_in_registers": (
        "if (cw < G::kRowWarps && tq == 0) flush_carry();",
        "if (false) flush_carry();",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's rank-0 carry goes on to rank 0's next k without adding what it held for the previous one
    "grad_weight_fed_carry_dropped_when_k_changes": (
        "flush_carry();\n              carry_k = k_of_rank[0];",
        "carry_k = k_of_rank[0];",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100"),
         "test_training_weight_gradient_with_many_channels_a_step[H100]"],
    ),
    # the fed dW's row warps read the producer's B of the step before (the other buffer)
    "grad_weight_fed_built_b_from_the_other_buffer": (
        "smem_u32(smem + G::kBOffset + ((step - begin) & 1) * G::kBBytes)",
        "smem_u32(smem + G::kBOffset + ((step - begin + 1) & 1) * G::kBBytes)",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's producer puts every pixel's B values (hi, and db's lo) in the low half of its word: odd ranks land in
    # even columns
    "grad_weight_fed_built_b_odd_ranks_in_even_columns": (
        "const uint32_t shift = 16 * (rank & 1), w = rank >> 1;",
        "const uint32_t shift = 0, w = rank >> 1;",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's bias warp never adds its second accumulator (each chunk's pixels 8-15; with B built for db, the odd
    # chunks)
    "grad_weight_fed_bias_drops_the_second_half": (
        "*at_k = fmaf(acc[0][r] + acc[1][r], down, *at_k);",
        "*at_k = fmaf(acc[0][r], down, *at_k);",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW's one-hot B puts every rank of a batch in the batch's first column
    "grad_weight_fed_one_hot_first_column": (
        "const uint32_t target = 8 * batch + gq;  // B's column gq: rank 8 batch + gq",
        "const uint32_t target = 8 * batch;",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # the fed dW takes one batch of 8 ranks a step: the pixels whose k ranks 9th or later in the step are dropped
    "grad_weight_fed_one_batch_a_step": (
        "return __popcll(held);",
        "return min(__popcll(held), 8);",
        ["test_training_weight_gradient_with_many_channels_a_step[H100]"],
    ),
    # the fed dW adds a batch's sums at the ranks' positions instead of their k
    "grad_weight_fed_sums_at_the_rank": (
        "at_k[r] = sums + (to_sums[r] ? k_of_rank[rank] : 0) * G::kPartial + c * G::kTaps + cw * G::kKsize;",
        "at_k[r] = sums + (to_sums[r] ? rank : 0) * G::kPartial + c * G::kTaps + cw * G::kKsize;",
        ["test_training_weight_gradient_with_many_channels_a_step[A100]"],
    ),
    # the fed dW's producer warps rank by their own warp's set of k, not the step's
    "grad_weight_fed_ranks_by_its_warp_alone": (
        "held |= held_words[w];\n            largest = max(largest, largest_words[w]);",
        "held = held_words[warp];\n            largest = max(largest, largest_words[w]);",
        ["test_training_weight_gradient_with_many_channels_a_step[H100]"],
    ),
    # the fed dW's bias warp adds a batch's db at the ranks' positions instead of their k
    "grad_weight_fed_bias_at_the_rank": (
        "float* const at_k = sums + k_of_rank[rank] * G::kPartial + G::kEntries;",
        "float* const at_k = sums + rank * G::kPartial + G::kEntries;",
        ["test_training_weight_gradient_with_many_channels_a_step[A100]"],
    ),
    # the fed dW's producer never stages the late items' channel vectors: the threads that store them read stale ones
    "grad_weight_fed_late_items_unstaged": (
        "if (late_lane) late_stage[lane] = in.late;",
        "if (false) late_stage[lane] = in.late;",
        ["test_training_weight_gradient_with_many_channels_a_step[H100]"],
    ),
    # the fed dW multiplies a step with a NaN or an infinity in its window instead of walking it
    "grad_weight_fed_never_walks": (
        "walks = walks << 1 | (row_walks(ring.slot(rows)) ? 1u : 0u);",
        "walks = walks << 1;",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-one_step-H100-tf32"),
         node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-A100-tf32")],
    ),
    # the fed dW walks a step only for its newest row: a NaN stays in the window two steps more
    "grad_weight_fed_walks_for_the_newest_row_only": (
        "if (walks & 7u) {  // a row of the window walks",
        "if (walks & 1u) {  // a row of the window walks",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-H100-tf32")],
    ),
    # the fed dW multiplies rows that are all tiny in fp16 (2^-24 steps, or 0 below 2^-24) instead of walking them
    "grad_weight_fed_ignores_tiny_rows": (
        "return (bits & G::kTooLargeBit) || ((bits & G::kNonzeroBit) && !(bits & G::kLargeBit));",
        "return (bits & G::kTooLargeBit) != 0;",
        [node("test_training_weight_gradient_keeps_its_precision_at_extreme_ranges", shape="aligned-tiny_x-H100"),
         node("test_training_weight_gradient_keeps_its_precision_at_extreme_ranges", shape="by_element-dust_x-A100"),
         node("test_training_weight_gradient_keeps_its_precision_at_extreme_ranges", shape="aligned-dust_x-A100"),
         "test_training_16bit_weight_gradient_walks_tiny_rows[H100]"],
    ),
    # the fed dW leaves a row's unstored last chunk as the slot's earlier row had it (an infinity times B's zeros)
    "grad_weight_fed_keeps_a_stale_late_chunk": (
        "if (producer.vec16 && !producer.reaches_late(col0) && ptid < G::Producer::kLate) {",
        "if (false) {",
        ["test_training_weight_gradient_ignores_an_earlier_strips_infinities[H100]"],
    ),
    # each producer warp scales its pixels' gm by its own largest |gm|, not the step's: the consumers undo warp 0's
    "grad_scale_of_one_warp": (
        "largest = max(largest, largest_words[w]);",
        "largest = max(largest, 0u);",
        ["test_training_weight_gradient_scale_sees_every_element_of_g[aligned-tf32]",
         "test_training_weight_gradient_scale_sees_every_element_of_g[offset-bf16]"],
    ),
    # the step's largest |gm| taken over NaNs and infinities too: a step with an infinite g scales its finite gm to 0
    "grad_scale_counts_infinities": (
        "if (magnitude < 0x7F800000u) largest = max(largest, magnitude);",
        "largest = max(largest, magnitude);",
        ["test_training_weight_gradient_infinite_g_keeps_its_steps_finite_gm[H100-tf32]",
         "test_training_weight_gradient_infinite_g_keeps_its_steps_finite_gm[A100-bf16]"],
    ),
    # the gradient of tanh(tanh(m)) without the inner tanh's factor
    "min_grad_drops_the_inner_tanh": (
        "return g * outer * inner;",
        "return g * outer;",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100")],
    ),
    # gm's inner factor kept where tanhf(m) is +-1: an infinite g there gives an infinity, where the reference has NaN
    "min_grad_keeps_the_saturated_factor": (
        "inner = fabsf(m) >= 9.0109138f ? 0.f : inner;",
        "inner = inner;",
        ["test_training_infinite_g_where_tanh_saturates_as_in_the_reference[H100-tf32-far]",
         "test_training_infinite_g_where_tanh_saturates_as_in_the_reference[A100-strict_fp32-far]"],
    ),
    # gm's inner factor 0 from one float below tanhf's saturation: an infinite g there gives NaN, where the reference
    # has an infinity
    "min_grad_saturates_one_float_early": (
        "inner = fabsf(m) >= 9.0109138f ? 0.f : inner;",
        "inner = fabsf(m) >= 9.0109129f ? 0.f : inner;",
        ["test_training_infinite_g_where_tanh_saturates_as_in_the_reference[H100-tf32-last_unsaturated]",
         "test_training_infinite_g_where_tanh_saturates_as_in_the_reference[A100-strict_fp32-last_unsaturated]"],
    ),
    # the wgmma lane-butterfly saving epilogue (3xTF32) keeps the channel within the warp, not within the 64
    "saved_argmin_drops_the_warp": (
        "keep_min(m, channel, minima[w * kRedPitch + at], 16 * w + channels[w * kRedPitch + at]);",
        "keep_min(m, channel, minima[w * kRedPitch + at], channels[w * kRedPitch + at]);",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100"),
         "test_every_kernels_saving_variant_follows_float64[sm90_tf32x3]"],
    ),
    # the pixel-row saving epilogue (wgmma, one product) lets a later channel of an equal value take the argmin
    "pixel_rows_ties_go_to_the_later_channel": (
        "const bool took = !(best <= v) && best == best;",
        "const bool took = !(best < v) && best == best;",
        ["test_argmin_order_is_torch_mins_in_any_fold_order",
         node("test_saving_forward_ties_go_to_the_first_channel", shape="bf16-H100"),
         node("test_saving_forward_ties_go_to_the_first_channel", shape="fp16-H100")],
    ),
    # the guarded kernels' pixel-row scan (finite sums) lets a later channel of an equal value take the argmin
    "pixel_rows_finite_ties_go_to_the_later_channel": (
        "const bool took = v < best;",
        "const bool took = v <= best;",
        [node("test_training_ties_go_to_the_first_channel", shape="H100"),
         node("test_saving_forward_ties_go_to_the_first_channel", shape="tf32-H100"),
         "test_argmin_order_is_torch_mins_in_any_fold_order"],
    ),
    # the pixel-row saving epilogue lets a number after a NaN take the argmin (and the min)
    "pixel_rows_number_beats_nan": (
        "const bool took = !(best <= v) && best == best;",
        "const bool took = !(best <= v);",
        ["test_saving_forward_takes_the_first_nan_channel[tf32]", "test_saving_forward_takes_the_first_nan_channel[bf16]"],
    ),
    # the pixel-row saving epilogue stores a lane's rows as sub-tile t: pixels of two sub-tiles swap places
    "pixel_rows_stored_at_the_wrong_sub_tile": (
        "const int s = 2 * (t & 1) + (t >> 1);",
        "const int s = t;",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-H100"),
         node("test_training_backward_follows_the_saved_argmin", shape="inference_forward-H100"),
         "test_every_kernels_saving_variant_follows_float64[sm90_tf32_f16]",
         "test_every_kernels_saving_variant_follows_float64[sm90_bf16]"],
    ),
    # the mma.sync saving epilogue drops the quad position from the channel
    "mma_sync_saved_channel_drops_the_quad": (
        "keep_min(lo, lo_ch, acc[mt][nt][e], 8 * nt + 2 * t + e);",
        "keep_min(lo, lo_ch, acc[mt][nt][e], 8 * nt + e);",
        [node("test_training_backward_follows_the_saved_argmin", shape="saving_forward-A100")],
    ),
    # dW forgets the reference's 0 * NaN for channels other than the pixel's argmin
    "grad_weight_forgets_zero_times_nan": (
        "      if ((poisoned >> kk) & 1) sums[kk * G::kPartial + e] = __int_as_float(0x7fffffff);\n",
        "",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-one_step-H100-strict_fp32"),
         node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-H100-strict_fp32")],
    ),
    # dX forgets the reference's 0 * inf for an infinite weight of another channel
    "grad_input_forgets_zero_times_inf": (
        "            if (bad_w[c * G::kTaps + tap] & others) acc[c] = __int_as_float(0x7fffffff);\n",
        "",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-one_step-A100-strict_fp32")],
    ),
    # dW's non-finite flag covers only the newest row of the window, not the three rows it holds
    "grad_weight_flags_only_the_newest_row": (
        "bad_slots = bad ? bad_slots | bit : bad_slots & ~bit;",
        "bad_slots = bad ? bit : 0u;",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-many_steps-H100-strict_fp32")],
    ),
    # NaN in one channel loses to the numbers of the others (precedes lets a number win over a NaN)
    "nan_loses_to_numbers": (
        "if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);",
        "if (a_nan || b_nan) return b_nan && (!a_nan || ia < ib);",
        [node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-one_step-H100-strict_fp32"),
         node("test_training_nan_and_inf_get_the_reference_gradients", shape="saving_forward-one_step-A100-strict_fp32"),
         "test_argmin_order_is_torch_mins_in_any_fold_order"],
    ),
    # forwards under autograd ignore the saving switch (always the inference op)
    "forward_ignores_the_saving_switch": (
        "if records and (torch.compiler.is_compiling() or _save_in_forward[0]):",
        "if False:",
        ["test_forward_under_autograd_follows_the_saving_switch",
         "test_training_saves_in_forward_from_the_first_backward_on"],
    ),
}


def run_mutant(name, workdir):
    original, mutated, tests = MUTANTS[name]
    tree = os.path.join(workdir, name)
    os.makedirs(tree)
    for f in PROJECT_FILES:
        shutil.copy(os.path.join(HERE, f), tree)
    for d in PROJECT_DIRS:
        shutil.copytree(os.path.join(HERE, d), os.path.join(tree, d), ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(tree, "model_new.py")
    with open(path) as f:
        text = f.read()
    assert text.count(original) == 1, f"{name}: the text to mutate is not in model_new.py exactly once"
    with open(path, "w") as f:
        f.write(text.replace(original, mutated))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(tree, "ext"), PYTHONUNBUFFERED="1")
    selection = [f"test_correctness.py::{t}" for t in tests]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    summary = next((line for line in reversed(out.splitlines()) if " in " in line and ("passed" in line or
                                                                                      "failed" in line)), "")
    caught = proc.returncode == 1 and "failed" in summary and " error" not in summary
    reasons = [line.strip() for line in out.splitlines() if line.startswith("E ")][:4]
    return name, caught, summary, reasons


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=sorted(MUTANTS), default=None, help="these mutants (default: all)")
    args = p.parse_args()
    names = args.only or list(MUTANTS)
    workdir = tempfile.mkdtemp(prefix="mutants_")
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: run_mutant(n, workdir), names))
    all_caught = True
    for name, caught, summary, reasons in results:
        all_caught &= caught
        print(f"mutant {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} by {', '.join(MUTANTS[name][2])}: {summary}")
        for line in reasons:
            print(f"    {line}")
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
