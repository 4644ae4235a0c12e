. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 50: S3's latency half (p99 ITL 3.0x a lone tenant's in session 50): compiled-step tenants with
# the gangs' lanes at the default stream priority and at the highest (--gang-priority -5: a round's kernels ahead of
# the tenants' queued ones; every round is on the critical path of its tenants), N = 1 beside (the lone tenant's
# latency the goal is relative to; s3_inference prints p99 over it). Later: gangs of 8 (--gang-slots 8: smaller
# rounds, smaller tails?), --tenant-waits auto,blocking (16 tenants spinning, the executor and MPS on 16 cores).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 585 python3 s3_inference.py --model llama-1b --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s51l --ns 1,16 --executors "normal=;high=--gang-priority -5" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -60 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null; rm -f $OUT/*executor.profile.json
echo quit | nvidia-cuda-mps-control
