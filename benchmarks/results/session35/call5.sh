. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 200 python3 -m pytest -m gpu -q -o faulthandler_timeout=60 tests/test_hosted_adapters.py > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
tail -15 /tmp/gputests.log > $OUT/gputests_tail.log
timeout -s ABRT 100 python3 benchmarks/probes/merge_switch.py --paths kernel --repeat 9 --tiles 64x256x64/8/3/g4,64x128x64/4/3/g4 --out $OUT/merge_switch.json > /tmp/merge.log 2>&1; echo rc=$? >> /tmp/merge.log
cp /tmp/merge.log $OUT/
cd benchmarks
timeout -s ABRT 420 python3 s9_hosted.py --model llama-1b --ns 64 --registered 2000 --max-processes 0 --seconds 8 --tag s35_m2000_n64 --out /tmp/s9 > /tmp/s9.log 2>&1; echo rc=$? >> /tmp/s9.log
grep -v "^  File\|^Extension\|^Current\|^Thread" /tmp/s9.log | head -60 > $OUT/s9.log; cp /tmp/s9/*.json $OUT/ 2>/dev/null; grep -v "^  File" /tmp/s9/*executor*.log | tail -30 > $OUT/s9_executor_tail.log 2>&1
nvidia-smi > $OUT/smi.txt
echo quit | nvidia-cuda-mps-control
