. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 540 python3 -m pytest -m gpu -v -o faulthandler_timeout=150 tests/test_gpu.py -k "gpu_side or gpu-batches or stalled or waits_on_the_gpu or killed_while or native_call_path or graph_replays" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    \|^Extension" /tmp/gputests.log | tail -40 > $OUT/gputests_tail.log
echo quit | nvidia-cuda-mps-control
