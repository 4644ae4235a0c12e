. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 250 python3 -m pytest -m gpu -v -o faulthandler_timeout=120 tests/test_gpu.py -k "gpu_side or gpu-batches" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    \|^Extension" /tmp/gputests.log | tail -40 > $OUT/gputests_tail.log
cd benchmarks
timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --executors "default=;gpub-nocatch=--solo-tokens 0 --gpu-batches --catch-up-us 0;gpub-nowait=--solo-tokens 0 --gpu-batches --catch-up-us 0 --inference-wait-us 0" --tag s36c --out /tmp/s3 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log
cp /tmp/s3/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
