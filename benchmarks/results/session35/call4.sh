. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 120 python3 benchmarks/probes/merge_switch.py --paths kernel --repeat 9 --tiles 64x256x64/8/3/g4,64x128x64/4/3/g4 --out $OUT/merge_switch.json > /tmp/merge.log 2>&1; echo rc=$? >> /tmp/merge.log
cp /tmp/merge.log $OUT/
cd benchmarks
timeout -s ABRT 450 python3 s9_hosted.py --model llama-1b --ns 16,64 --registered 2000 --max-processes 0 --seconds 8 --tag s35_m2000 --out /tmp/s9 > /tmp/s9.log 2>&1; echo rc=$? >> /tmp/s9.log
cp /tmp/s9.log $OUT/; cp /tmp/s9/*.json $OUT/ 2>/dev/null; tail -20 /tmp/s9/*executor*.log > $OUT/s9_executor_tail.log 2>&1
echo quit | nvidia-cuda-mps-control
