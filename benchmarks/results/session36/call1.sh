. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout -s ABRT 230 python3 -m pytest -m gpu -q -x -o faulthandler_timeout=100 tests/test_gpu.py -k "gpu_side or four_fine_tuning or stalled or waits_on_the_gpu or killed_while" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    " /tmp/gputests.log | tail -40 > $OUT/gputests_tail.log
cd benchmarks
timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --executors "default=;gpubatch=--solo-tokens 0 --gpu-batches" --tag s36a --out /tmp/s3 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log
cp /tmp/s3/*.json $OUT/ 2>/dev/null; for f in /tmp/s3/executor*.log; do echo "== $f"; grep -v "^  File" $f | tail -15; done > $OUT/s3_executor_tails.log 2>&1
echo quit | nvidia-cuda-mps-control
