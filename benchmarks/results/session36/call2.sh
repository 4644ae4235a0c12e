. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 280 python3 -m pytest -m gpu -v -x -o faulthandler_timeout=120 tests/test_gpu.py -k "gpu_side or four_fine_tuning or stalled or waits_on_the_gpu" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    \|^Extension" /tmp/gputests.log | tail -60 > $OUT/gputests_tail.log
cd benchmarks
timeout -s INT 300 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "default=;gpubatch=--solo-tokens 0 --gpu-batches" --tag s36b --out /tmp/s3 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log
cp /tmp/s3/*.json $OUT/ 2>/dev/null; for f in /tmp/s3/executor*.log; do echo "== $f"; grep -v "^  File" $f | grep -v "mailboxes of process" | tail -12; done > $OUT/s3_executor_tails.log 2>&1
echo quit | nvidia-cuda-mps-control
