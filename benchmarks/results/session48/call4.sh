. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# Session 48, call 4: how rounds gather. Call 3: 4 lanes, 2000 us: 634.1 tokens/s against 547.2 processes (4.57 runs a
# round); 500 us: 497.1 (2.81). Here, with the processes: the default (4 lanes, 2000 us), one lane at 8000 us (every
# round waits for the lane: one convoy), two lanes at 8000 us.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
left=$(( 560 - SECONDS ))
cd benchmarks && timeout -s INT $left python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s48i --executors "gangs=;lanes1=--gang-lanes 1 --gang-wait-us 8000;lanes2=--gang-lanes 2 --gang-wait-us 8000" \
  --tenant-flags "graphs=--step-graphs" > $d/s3.log 2>&1; echo rc=$? >> $d/s3.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s3.log | tail -40; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|grown to\|captured\|CUDAGraph.cpp" $e | tail -12; done; } > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
