. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 51, call 3. (1) The gang LoRA kernels reworked after call 1 (one place's deltas in one shrink and one
# expand, wide and shallow) on the GPU: the kernel in float32 and bfloat16, four hosted tenants in gangs. (2) S9 at
# N = 16, compiled steps, hosted against private (call 1: hosted 0.84x private with the old kernels). (3) S3 at N = 16
# for the latency: call 2's profile showed a tenant's handover waits at p99 2.15 ms, the gangs' wait for a round's
# members (--gang-wait-us 2000) among them; here rounds wait at most 500 µs, the compiled-step tenants with four graph
# nodes a handover and with the fused handovers (two kernels; their test passed in call 1).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 140 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 130 -rfE --tb=short -s \
  -k "gang_lora or hosted_adapters_of_four" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 215 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --seconds 8 --out $d --tag s51h \
  --max-processes 0 --tenant-flags="--step-graphs --compiled-steps" > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent\|FutureWarning\|warnings.warn" $d/s9.log | tail -30 > $OUT/s9.txt 2>&1
timeout -s INT 215 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s51w --executors "w500=--gang-wait-us 500" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;handover=--step-graphs --compiled-steps --fused-handover" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
