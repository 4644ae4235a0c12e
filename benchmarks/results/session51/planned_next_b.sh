. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 51: S3's latency half. Session 51's profile: a token is ~19 round calls, each ~200 us waiting
# for the round's slowest member and ~200 us of the layer's kernels beside 16 tenants' (probes/round_anatomy.py),
# and a tenant's own kernels queue ~4.2 ms a token behind other processes'. (1) A lone compiled-step tenant (the
# goal's denominator). (2) 16 of them as they are, each held to a quarter of the SMs under MPS (--mps-threads 25),
# and each at MPS's below-normal client priority (--mps-priority 1: the executor's round kernels, on every member's
# path, go first), and with compiled prefills (--compiled-prefill: an eager prefill is ~1,000 launches in a burst
# the others' steps share the GPU with). Take planned_next.sh's winner of the word waits' warps as the baseline.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 70 python3 s3_inference.py --model llama-1b --ns 1 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s52l --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3l.log 2>&1
echo rc=$? >> $d/s3l.log
timeout -s INT 400 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d --tag s52b \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;mps25=--step-graphs --compiled-steps --mps-threads 25;low=--step-graphs --compiled-steps --mps-priority 1;cprefill=--step-graphs --compiled-steps --compiled-prefill" > $d/s3a.log 2>&1
echo rc=$? >> $d/s3a.log
cd ..
for f in s3l s3a; do grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/$f.log | tail -40 > $OUT/$f.txt 2>&1; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
