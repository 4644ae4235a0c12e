. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 48, call 2: gangs of step programs (base_executor/transports/gangs.py): their GPU parity test, then S3 at
# N = 16 with step-graphed tenants on an executor with gangs (default) and without (--gang-slots 0), against 16 processes.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 180 -rfE --tb=short --durations=0 -s \
  -k "gangs" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A12 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached" | tail -80; } >> $OUT/gpu_tests.txt 2>&1
d=/tmp/r/g; mkdir -p $d
left=$(( 575 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s48g --executors "gangs=;alone=--gang-slots 0" --tenant-flags "graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured" $e | tail -14; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
