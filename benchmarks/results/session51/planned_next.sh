. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 51 (no device time left): the next session's first call. What session 51 built after its last
# call, on the GPU: the gang test with one-warp word waits on both sides (serve --spin-warps 1, graph_words.SPIN_WARPS)
# and compiled steps whose prefills run compiled too (StepGraphs.compiled_prefill). Then S3 at N = 16: the processes,
# the compiled-step tenants as they are and with compiled prefills (an eager prefill is ~1,000 launches in a burst
# the others' steps share the GPU with; the p99's tail?). Then planned_next_b.sh.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 220 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short -s \
  -k "fused-spin1 or compiled-prefill" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s52a --tenant-flags "cgraphs=--step-graphs --compiled-steps;cprefill=--step-graphs --compiled-steps --compiled-prefill" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
