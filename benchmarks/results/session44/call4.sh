. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
s3() { name=$1; shift; d=/tmp/r/$name; mkdir -p $d
  cd benchmarks && timeout -s INT 170 python3 s3_inference.py --model llama-1b --mixed none --seconds 8 --out $d --tag s44$name "$@" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
  { grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -12; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -6; done; } > $OUT/$name.txt 2>&1; }
# S3 at N = 64 as 16 processes of 4 (their calls wait for their replies), then N = 16 one a process beside 16 processes
s3 n64 --ns 64 --max-processes 0 --tenants-per-process 4
s3 n16 --ns 16 --max-processes 16
# the GPU tests nearest the change (return early, waits, stalls), as many as fit
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -x -p no:cacheprovider -k "two_same_gpu or wait or stall or early or killed or two_streams or two_placements" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
