. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 50, call 2 (planned in session 49 as planned_next_s3.sh) (if planned_next.sh's tests passed).
# S3 N = 16: the processes; compiled-step tenants on an executor with fused spans (their LoRA linears as reductions,
# and as cuBLAS GEMMs: --gemm-linears), and on one with eager spans. If fused spans win, make --gang-spans fused the
# default; if the reductions lose, make small_linears False the default. Later calls: --process-flags
# "eager=;compiled=--compile default" (compiled processes, the fair baseline for compiled tenants), N = 1 and 32,
# and --gpu-profile 16 (fleet_timeline now prints tenant 0's and the executor's kernels by name).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 480 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s50c2 --executors "fused=--gang-spans fused;spans=" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;gemm=--step-graphs --compiled-steps --gemm-linears" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
# the fused-span test as fixed after call 1 (it built its spans on the GPU, its norm probe on the host)
timeout -s INT 80 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 60 -rfE --tb=short \
  -k "fused_span_is" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
