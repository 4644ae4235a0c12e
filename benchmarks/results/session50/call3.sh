. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 50, call 3 (the last ~600 s of device time): (1) hosted adapters in gangs (new: kernels/gang_lora.py, each
# slot's adapter inside the fused spans): four tenant processes with their own hosted adapters, and the lone hosted
# step-graph test; (2) S3 at N = 1 and 16 with fused spans now the default: the processes and compiled-step tenants,
# for the latency half of S3's goal (p99 ITL at N = 16 against the tenant alone).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 230 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short -s \
  -k "hosted_adapters_of_four_tenants or hosted_adapter_decode" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A30 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -30; } >> $OUT/gpu_tests.txt 2>&1
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s50c3 --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
