. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# session 47, call 4: step programs with a hosted adapter (GPU test), then S3 N = 16: step-graphed tenants with
# private adapters and with their adapters hosted by the executor (fewer kernels of their own a token), beside 16 processes
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 100 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 60 -rfE --tb=short --durations=0 \
  -k "step_graphs_with_a_hosted" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/n16; mkdir -p $d
left=$(( 395 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d --tag s47c \
  --tenant-flags "graphs=--step-graphs" --hosted > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured" $e | tail -12; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
