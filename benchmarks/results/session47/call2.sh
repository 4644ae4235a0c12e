. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# session 47, call 2: step programs (client/step_graphs.py) on the GPU: the probe again (transformers' decode step
# captured; graph words by kernels; which memop invalidated call 1's capture), the parity test, the tests the
# native lane and graphs.py changes touch, call 1's failure twice more; then S3 N = 16, eager tenants against
# step-graphed tenants, beside 16 processes
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 120 python3 benchmarks/probes/graphed_step.py --model llama-1b > $OUT/graphed_step.txt 2>&1; echo rc=$? >> $OUT/graphed_step.txt
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 100 -rfE --tb=short --durations=0 \
  -k "step_graphs or native_call_path or graph_replays_equal or call_taken_before" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
timeout -s INT 60 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 50 -rfE --tb=long \
  -k "call_taken_before and python" > $OUT/gpu_tests_again.txt 2>&1; echo rc=$? >> $OUT/gpu_tests_again.txt
d=/tmp/r/n16; mkdir -p $d
left=$(( 575 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d --tag s47 \
  --tenant-flags "eager=;graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of" $e | tail -12; done; ls $d; } > $OUT/n16.txt 2>&1
grep -h -i "warn\|error\|Traceback" $d/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -30 > $OUT/n16_warnings.txt
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
