. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; lscpu | grep "Model name" >> $OUT/gpu.txt
# the GPU test call 1 did not finish (four fine-tuning tenants [gpu-batches])
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 190 -rfE --tb=short --durations=0 -k "four_fine and gpu" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
# issue 19: S3 N = 64 (16 processes of 4 tenants, which wait for their replies) as it is, and with each tenant thread settling its
# stream after a forward with the GIL released (hypothesis: generate's pageable read of the next token holds up the other threads' launches)
d=/tmp/r/n64; mkdir -p $d
left=$(( 565 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --mixed none --seconds 8 --out $d --tag s46 --ns 64 --max-processes 0 --tenants-per-process 4 \
  --tenant-flags "default=;settle=--settle-forward" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -30; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -6; done; } > $OUT/n64.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
