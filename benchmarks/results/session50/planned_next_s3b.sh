. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 50: the next session's third call. S3 N = 16: the processes as users run them and compiled
# (--compile default: the fair baseline for compiled tenants); the compiled-step tenants with four graph nodes a
# handover and with two (--fused-handover, if planned_next.sh's handover test passed). Then planned_next_s3c.sh.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 170 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 160 -rfE --tb=short -s \
  -k "fused-high" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt  # (the gang test, lanes at the highest priority)
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 410 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s51w --process-flags "eager=;compiled=--compile default" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;handover=--step-graphs --compiled-steps --fused-handover" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -60 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null; rm -f $OUT/*executor.profile.json
echo quit | nvidia-cuda-mps-control
