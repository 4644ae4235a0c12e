. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# session 47, call 3: step graphs' parity test (call 2 ran out of time before it), then S3 at N = 1 and 16:
# eager tenants and step-graphed tenants on one executor, beside the processes
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 130 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 60 -rfE --tb=short --durations=0 \
  -k "step_graphs" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/n16; mkdir -p $d
left=$(( 575 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --out $d --tag s47b \
  --tenant-flags "eager=;graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to" $e | tail -12; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
