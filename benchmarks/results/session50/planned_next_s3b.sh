. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 50: the next session's third call. S3 N = 16: the processes as users run them and compiled
# (--compile default: the fair baseline for compiled tenants); the compiled-step tenants spinning (auto) and sleeping
# (blocking) while they wait for their GPU (16 tenants, the executor and MPS on 16 cores).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 585 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s51w --process-flags "eager=;compiled=--compile default" --tenant-waits auto,blocking \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -60 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null; rm -f $OUT/*executor.profile.json
echo quit | nvidia-cuda-mps-control
