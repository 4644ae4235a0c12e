. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 51, call 2: S3's latency half (p99 ITL 3.0x a lone tenant's in session 50). 16 compiled-step tenants (no
# processes: the throughput against them is call 3's), the gangs' lanes at the default stream priority and at the
# highest (--gang-priority -5), each profiled (--gpu-profile 16) and its round anatomy printed
# (benchmarks/probes/round_anatomy.py: a tenant's token as its own kernels and its handover waits; the executor's
# round calls as the wait for the round's tenants and the work after it; the kernels a tenant launches a token).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 540 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s51p --executors "normal=;high=--gang-priority -5" --tenant-flags "cgraphs=--step-graphs --compiled-steps" \
  --gpu-profile 16 > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log > $OUT/s3.txt 2>&1
for f in $d/*_spans.json.gz; do
  python3 benchmarks/probes/round_anatomy.py $f --tenants 2 > $OUT/anatomy_$(basename $f _spans.json.gz | sed 's/.*symbiont-//').txt 2>&1
done
cp $d/s3_*s51p.json $d/*timeline.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
