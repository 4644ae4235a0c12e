. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 50: the next session's second call. S3 N = 16 with a GPU timeline (--gpu-profile 16: tenant 0's
# and the executor's kernels by name, launches a token): where a compiled-step tenant's ~540 launches a token go now
# that the executor's spans are fused, for the latency half of S3's goal (p99 ITL 3.0x a lone tenant's in session 50).
# Then planned_next_s3b.sh.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 585 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s51p --tenant-flags "cgraphs=--step-graphs --compiled-steps" --gpu-profile 16 > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -60 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null; rm -f $OUT/*executor.profile.json
echo quit | nvidia-cuda-mps-control
