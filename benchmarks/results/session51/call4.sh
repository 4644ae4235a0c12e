. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 51, call 4 (the last ~5 min of device time): S3 at N = 16 at HEAD, the processes first, then the
# compiled-step tenants: this session's serving-path changes (the gang LoRA kernels, a member making calls of its
# own not waited for by its gangs' rounds) against the processes in one run.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 250 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s51h --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
