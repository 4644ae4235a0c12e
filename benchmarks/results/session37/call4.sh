. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 120 python3 -m pytest -m gpu -v -o faulthandler_timeout=100 tests/test_gpu.py -k "held_behind or stalled_input" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    \|^Extension" /tmp/gputests.log | tail -12 > $OUT/gputests_tail.log
cd benchmarks
tails() { for f in $1/executor*.log; do echo "== $f"; grep -v "^  File" $f | grep -v "mailboxes of process\|detached" | tail -5; done; }
timeout -s INT 170 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --tag s37eager4 --out /tmp/s3e > $OUT/s3e.log 2>&1; echo rc=$? >> $OUT/s3e.log
cp /tmp/s3e/*.json $OUT/ 2>/dev/null; tails /tmp/s3e > $OUT/s3e_executor_tails.log 2>&1
timeout -s INT 150 python3 s4_mixed.py --model llama-1b --seconds 8 --train-mps-threads ",25" --tag s37b --out /tmp/s4 > $OUT/s4.log 2>&1; echo rc=$? >> $OUT/s4.log
cp /tmp/s4/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
