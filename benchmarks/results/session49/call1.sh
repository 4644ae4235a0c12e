. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 49, call 1: session 48's planned next call, as planned then.
# (1) The GPU tests of everything after call 3 (430f6c5): the review's fixes to gangs (shared lane streams, setup
# stream, slot reuse, stall detection), the capture fixes (24d3638: no garbage collection during a capture, a failed
# capture's pool ended and not reused; call 5's gang test failed on a capture a collection invalidated), the unified
# copy kernel; with the step-graph and stalled-tenant tests.
# (2) S3 at N = 16, gangs against the processes, with a GPU timeline of the gang fleet whose summary now leaves the
# word-wait kernels out (fleet_timeline: where a round's 22-25 ms a token go).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 260 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short --durations=0 -s \
  -k "gangs or step_graphs or stalled or killed_while_the_gpu_waits" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
{ echo "#### executor logs"; grep -h -B2 -A30 "gang\|Traceback" ${TMPDIR:-/tmp}/test-*.log | grep -v "attached;\|detached\|CUDAGraph.cpp" | tail -60; } >> $OUT/gpu_tests.txt 2>&1
d=/tmp/r/g; mkdir -p $d
left=$(( 575 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s49 --tenant-flags "graphs=--step-graphs" --gpu-profile 16 > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured\|CUDAGraph.cpp" $e | tail -12; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
