. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 52, call 3 (the last of the session's device time). (1) The gang test (four tenants' step programs in
# gangs with fused spans: tokens their lone runs' and the unsplit model's) at this session's gang word kernels (one
# warp; the wait loads again only the words still short; copy_rows' mask a block). (2) S3 at N = 1 then N = 16 on
# one executor, compiled steps: the latency goal's denominator and numerator in one run (call 2's lone run was cut
# by its 70 s limit). (3) S9 at N = 16 with compiled steps, hosted against private, at the one-warp waits.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 140 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 130 -rfE --tb=short -s \
  -k "step_programs_of_four_tenants_run_in_gangs and fused-steps" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 215 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s52l --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
timeout -s INT 205 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --seconds 8 --out $d --tag s52h \
  --max-processes 0 --tenant-flags="--step-graphs --compiled-steps" > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent\|FutureWarning\|warnings.warn" $d/s9.log | tail -30 > $OUT/s9.txt 2>&1
cd ..
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
