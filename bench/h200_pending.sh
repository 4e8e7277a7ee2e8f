#!/usr/bin/env bash
# The H200 measurements the open issues still wait for, in two parts that each fit one device call
# (10 minutes): `bash bench/h200_pending.sh 1` and `bash bench/h200_pending.sh 2`; part 3 is the FP8
# kernels and precision paths (issue 34) with Cosmos 3's decode (issue 36), part 4 the 14B step and the
# one-GPU parallel baselines (issue 37), part 5 the diagnostics of the three misses left open: where a
# graphed Cosmos 3 token spends its time, the fp8 driver on cross-attention, the VAE under cuDNN's
# autotuner; part 6 Cosmos 3's decode with chained steps beside one-token steps (and captured prefills),
# part 7 realtime sessions on the fused ops, part 8 the captured decode with the Triton decode kernels beside without
# (their tests on the GPU first) and where the host's share of a decode goes, part 9 realtime sessions with the
# attention kernel left to PyTorch beside cuDNN's pinned, part 10 the VAE decode with its conv biases fused and in
# exact halo tiles, then FastWan end to end on its default path, part 11 the fused fp8 quantization (tests, kernels,
# the 1.3B step's paths), part 12 the aligned halo tiles again and 2D forms of the VAE's 3D convs, part 13 part 11
# again after its first run's fixes (each test suite on its own, the fused GELU's launch forms) with the conv probe,
# part 14 Cosmos 3's captured decode (chains of 8, the Triton decode kernels) on the H200 its targets name, part 15 the
# VAE decode on a second device lane beside the next request's denoise (with the lane tests on CUDA). Every bench runs
# under its own timeout, writes its JSON under $OUT (default out/h200) and its log beside it, so a
# bench that fails or runs out of time costs only its own slot; the last lines of each log are
# printed at the end. docs/benchmarks.md says which section records each figure.
#
# The device machine has torch and triton but not every package: wheels carried in $WHEELS (default
# .whlb/: pydantic, diffusers, stevedore, ...) are installed into /tmp/site first when that folder is present.
set -u
part="${1:?usage: bash bench/h200_pending.sh 1|2|...|15}"
case "$part" in 1|2|3|4|5|6|7|8|9|10|11|12|13|14|15) ;; *) echo "part must be 1 to 15, got $part" >&2; exit 2 ;; esac
out="${OUT:-out/h200}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
wheels="${WHEELS:-.whlb}"
if [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/fv-wan -e plugins/fv-rl \
    -e plugins/fv-cosmos3 > "$out/install.log" 2>&1 || { tail -n 20 "$out/install.log"; exit 1; }

run() {  # run NAME SECONDS COMMAND...: one bench, its log at $out/NAME.log
    local name="$1" seconds="$2"
    shift 2
    echo "== $name (at most ${seconds} s): $*"
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
}

case "$part" in
1)
    # issue 32: one session's FPS and first chunk, prompt updates, 2 and 4 sessions (1.3B causal, bf16)
    run realtime 200 python3 bench/bench_realtime.py "$out/realtime.json" --seconds 20
    # issue 34: the precision paths' step times and quality on Wan 1.3B
    run precision 150 python3 bench/bench_precision.py "$out/precision"
    # issue 36 section 1: Cosmos 3's graphed decode against eager
    run cosmos3_decode 150 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano --sections decode
    ;;
2)
    # issue 36 section 2: the statistical tier contract on FastWan (3 samples), then the default path end to end
    # (the e2e section also prints the loops' host share of execute time: section 3)
    run tier_parity 260 python3 bench/bench_tier_parity.py --card fastwan2.1-t2v-1.3b --device cuda --tiers fused graphs \
        --samples 3 --budget-s 240 --cache-dir /tmp/tier_cache --record "$out/tier_parity_h200.json" --json "$out/tier_parity.json"
    run gpu_e2e 150 python3 bench/bench_gpu.py "$out/gpu" --skip matmul dit diffusers graphs step_parts vae step_batching \
        compiled --concurrency 1 8 --budget-s 140
    # issue 36 section 4: the main job's cold start on the GPU machine
    # (fv serve needs the serve extra: without fastapi on the machine, fv generate alone)
    python3 -c "import fastapi" 2> /dev/null && serve_flag="" || serve_flag="--generate-only"
    run cold_start 100 python3 bench/bench_first_request.py --cold-start --device cuda --runs 2 $serve_flag
    ;;
3)
    # issue 34: the fp8 kernels (every tile candidate) and the precision paths' Wan-1.3B step beside diffusers;
    # issue 36 section 1: Cosmos 3's decode, with the rows each token step really ran (and fused, measured)
    run fp8_kernels 240 python3 bench/bench_fp8_kernels.py --sweep --out "$out/fp8_kernels.json"
    run precision 150 python3 bench/bench_precision.py "$out/precision" --iters 3
    run cosmos3_decode 150 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano --sections decode
    ;;
4)
    # issue 34: the 14B 720p step on each path (needs about 100 GiB free: an H200); issue 37: one-GPU baselines
    run precision_14b 300 python3 bench/bench_precision.py "$out/precision_14b" --models 14b --iters 3
    run parallel_baselines 240 python3 bench/bench_parallel.py --baselines --iters 3 --warmup 1 --out "$out/parallel_baselines.json"
    ;;
5)
    # issue 36 section 1: a graphed batch-1 token split into the captured step alone and the rest,
    # with the step's kernels by device time (decode_kernels.txt)
    run cosmos3_decode 200 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano \
        --sections decode --decode-tiers graphed
    # issue 34: the fp8 driver on Wan's cross-attention shape beside self-attention
    run fp8_kernels 100 python3 bench/bench_fp8_kernels.py --out "$out/fp8_kernels.json" --sections fused_quantization linear
    # issue 36 section 2: the VAE decode with the cuDNN autotuner row
    run vae_decode 150 python3 bench/bench_vae_decode.py "$out/vae"
    ;;
6)
    # issue 36 section 1: the graphed decode scheduling every token and 8 tokens per step (chained), one run
    run cosmos3_decode 260 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano \
        --sections decode --decode-tiers graphed --decode-tokens-per-step 1 8
    ;;
7)
    # issue 32: one, two and four sessions with the DiT's and the VAE's fused Triton ops
    run realtime_fused 250 python3 bench/bench_realtime.py "$out/realtime_fused.json" --seconds 12 --fused-ops triton
    ;;
8)
    # issue 36 sections 1 and 3: the decode kernels' tests on the GPU, then chains of 8 with and without the kernels
    # (compute.fused_ops: triton), each tier's batch 8 once more under cProfile (decode_host_<tier>.txt)
    run decode_kernel_tests 150 bash -c "cd plugins/fv-cosmos3 && python3 -m pytest -q -p no:cacheprovider \
        tests/test_decode_kernels.py tests/test_graphed_decode_cuda.py"
    run cosmos3_decode 330 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano \
        --sections decode --decode-tiers graphed --decode-tokens-per-step 8 --decode-kernels off triton --host-profile
    ;;
9)
    # issue 32: one and two sessions on the fused ops, SDPA's own kernel choice against cuDNN's attention pinned
    run realtime_sdpa 220 python3 bench/bench_realtime.py "$out/realtime_sdpa.json" --seconds 10 --sessions 2 \
        --fused-ops triton
    run realtime_cudnn 220 python3 bench/bench_realtime.py "$out/realtime_cudnn.json" --seconds 10 --sessions 2 \
        --fused-ops triton --attention-backend sdpa_cudnn
    ;;
10)
    # issue 36 section 2: the VAE's tests on the GPU, the decode (biases fused; exact halo tiles 1x2 and 1x3),
    # then FastWan end to end on the default path
    run vae_tests 120 bash -c "cd plugins/fv-wan && python3 -m pytest -q -p no:cacheprovider \
        tests/test_vae_fused_decode.py tests/test_vae_halo.py"
    run vae_decode 200 python3 bench/bench_vae_decode.py "$out/vae" --halo 1 2
    run vae_decode_halo3 150 python3 bench/bench_vae_decode.py "$out/vae_halo3" --halo 1 3 --iters 2
    run gpu_e2e 150 python3 bench/bench_gpu.py "$out/gpu" --skip matmul dit diffusers graphs step_parts vae step_batching \
        compiled --concurrency 1 8 --budget-s 140
    ;;
11)
    # issue 34: the fused fp8 quantization's tests on the GPU, the kernels, and the 1.3B step's paths (with the
    # fp8_dynamic row's quantization unfused beside it)
    run fp8_tests 100 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_compute_fp8_fused_quantization.py \
        && cd plugins/fv-wan && python3 -m pytest -q -p no:cacheprovider \
        tests/test_fp8_fused_quantization_wan.py tests/test_compute_fused_wan.py"
    run fp8_kernels 60 python3 bench/bench_fp8_kernels.py --out "$out/fp8_kernels.json" --sections fused_quantization
    run precision 150 python3 bench/bench_precision.py "$out/precision" --iters 3
    ;;
12)
    # issue 36 section 2: the exact halo tiles (aligned, the default) after the lifetime fix, and 2D forms of the 3D convs
    run vae_decode 220 python3 bench/bench_vae_decode.py "$out/vae" --halo 1 2
    run conv_forms 100 python3 bench/probe_conv_forms.py "$out/conv_forms.json"
    ;;
13)
    # issue 34 after part 11's H100 run (QuantizedRows on the auto kernel, bf16 judged code by code, the GELU's
    # two-pass form): the tests suite by suite, the fused ops and the GELU's launch forms, the 1.3B step's
    # paths; issue 36: 2D forms of the VAE's 3D convs
    run fp8_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_compute_fp8_fused_quantization.py \
        tests/test_compute_fp8_kernels.py
    run fp8_tests_wan 90 bash -c "cd plugins/fv-wan && python3 -m pytest -q -p no:cacheprovider \
        tests/test_fp8_fused_quantization_wan.py tests/test_compute_fused_wan.py"
    run fp8_kernels 60 python3 bench/bench_fp8_kernels.py --out "$out/fp8_kernels.json" --sections fused_quantization
    run precision 170 python3 bench/bench_precision.py "$out/precision" --iters 3
    run conv_forms 100 python3 bench/probe_conv_forms.py "$out/conv_forms.json"
    ;;
14)
    # issue 36 section 1 on an H200 (never measured there; the H100 gave 139 and 714 tok/s): batch 1 and 8
    run cosmos3_decode 420 python3 bench/bench_cosmos3.py "$out/cosmos3_decode.json" --card cosmos3-nano \
        --sections decode --decode-tiers graphed --decode-tokens-per-step 8 --decode-kernels triton
    ;;
15)
    # issue 36 section 2: FastWan requests arriving one denoise apart, one device lane against the VAE decode on
    # a second lane (scheduler.overlap_kinds); then the lane tests (wan-tiny's run on CUDA too, with the graphs tier)
    run overlap 300 python3 bench/bench_gpu.py "$out/gpu_overlap" --skip matmul dit diffusers graphs step_parts vae \
        step_batching engine_throughput e2e compiled
    run overlap_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_lanes.py \
        plugins/fv-wan/tests/test_overlap_decode_wan.py
    ;;
esac
for log in "$out"/*.log; do
    echo "---- $log"
    tail -n 6 "$log"
done
