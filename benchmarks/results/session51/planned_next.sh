. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 51 (no device time left): the next session's first call. S3's latency (p99 ITL ~3x a lone
# tenant's; goal 2x). Session 51's profile: a token is ~19 round calls, each ~200 us waiting for the round's slowest
# member and ~200 us of the layer's kernels beside 16 tenants' (benchmarks/probes/round_anatomy.py). (1) The gang
# test with one-warp word waits on both sides (~2 min). (2) S3 at N = 1 and 16: the processes, the compiled-step
# tenants as they are and with each tenant held to a quarter of the SMs under MPS (--mps-threads 25: the executor's
# round kernels find SMs free?). (3) An executor whose word waits are one warp, its tenants' too (--spin-warps 1:
# the waits spin on host memory across PCIe, 16 tenants and 4 lanes at once).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 140 -rfE --tb=short -s \
  -k "fused-spin1" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s52a --tenant-flags "cgraphs=--step-graphs --compiled-steps;mps25=--step-graphs --compiled-steps --mps-threads 25" > $d/s3a.log 2>&1
echo rc=$? >> $d/s3a.log
timeout -s INT 110 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s52b --executors "spin1=--spin-warps 1" --tenant-flags "spin1=--step-graphs --compiled-steps --spin-warps 1" > $d/s3b.log 2>&1
echo rc=$? >> $d/s3b.log; cd ..
for f in s3a s3b; do grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/$f.log | tail -40 > $OUT/$f.txt 2>&1; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
