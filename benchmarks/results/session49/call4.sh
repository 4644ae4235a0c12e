. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 49, call 4 (the last ~300 s of device time): S3 N = 16 again, the processes, the compiled-step tenants and
# the eager-step tenants (session 48's gangs) on one executor, in that order: call 3's 1.46x a second time, and what the
# compile adds in the same run. Each fleet's JSON line is in s3.txt as it ends (the run may be cut by the limit).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 255 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s49d --tenant-flags "cgraphs=--step-graphs --compiled-steps;graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
