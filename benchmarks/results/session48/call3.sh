. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 48, call 3: gangs with lanes (a gang's rounds on 4 streams; a round queued only on an idle lane, once the
# members it waits for have asked or --gang-wait-us passed). Call 2: one stream, rounds queued behind each other
# fragmented into 2.35 runs a round, 122 tokens/s against 512 alone; and the capture of the GPU test's gang failed once.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 180 -rfE --tb=short --durations=0 -s \
  -k "gangs" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A40 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -90; } >> $OUT/gpu_tests.txt 2>&1
d=/tmp/r/g; mkdir -p $d
left=$(( 580 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s48h --executors "gangs=;gangs500=--gang-wait-us 500;alone=--gang-slots 0" --tenant-flags "graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured\|CUDAGraph.cpp" $e | tail -30; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
