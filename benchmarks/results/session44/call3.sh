. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the GPU tests (two tenants of one process wait for their replies: new)
timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py -x -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
# S3 at N = 64 as 16 processes of 4 (their calls now wait for replies), beside one plain process with 64 adapters
d=/tmp/r/s3n64; mkdir -p $d
cd benchmarks && timeout -s INT 200 python3 s3_inference.py --model llama-1b --ns 64 --max-processes 0 --mixed 64 --seconds 8 --tenants-per-process 4 --out $d --tag s44n64 > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -30; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached" $e | tail -12; done; } > $OUT/s3n64.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
