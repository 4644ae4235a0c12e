. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 49 (no device time left): the next session's first call, as planned then.
# (1) GPU tests of what session 49 built after its last device call: fused spans in gangs (runner.span_fused,
# kernels/span_norms.py; serve --gang-spans fused, off by default until this passes), the gang test with both, and the
# compiled steps' parity test again. (2) S3 N = 16: the processes against compiled-step tenants on an executor with
# eager spans and one with fused spans. If the fused spans pass and win, make --gang-spans fused the default.
# The tests take ~6 min (the gang test three times: eager spans, fused spans, fused spans with compiled steps): if
# the S3 part is cut, run it alone in the next call. A further call: the same S3 with --process-flags "eager=;compiled=--compile default" (compiled processes beside the
# eager ones: the fair baseline for compiled tenants) and N = 32.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 420 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short --durations=0 -s \
  -k "fused_span or gangs or step_graphs_decode" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A30 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -40; } >> $OUT/gpu_tests.txt 2>&1
d=/tmp/r/g; mkdir -p $d
left=$(( 585 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s50 --executors "spans=;fused=--gang-spans fused" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
