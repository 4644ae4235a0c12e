. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 170 python3 benchmarks/probes/merge_switch.py --paths kernel --repeat 5 --tiles 32x256x32/4/3,16x256x64/4/3/g8,16x256x64/4/3/g16,16x256x64/2/3/g8,16x512x64/8/3/g8,32x256x64/4/3/g8,64x256x64/8/3/g4,16x256x64/4/1/g8,32x256x64/8/3/g8,16x128x64/2/3/g8 --out $OUT/merge_switch.json > /tmp/merge.log 2>&1; echo rc=$? >> /tmp/merge.log
cp /tmp/merge.log $OUT/
cd benchmarks
export TORCHINDUCTOR_COMPILE_THREADS=1
timeout -s ABRT 400 python3 s3_inference.py --model llama-1b --ns 4,16 --max-processes 16 --mixed none --seconds 8 --compile default --tag s35compile --out /tmp/s3c > /tmp/s3c.log 2>&1; echo rc=$? >> /tmp/s3c.log
cp /tmp/s3c.log $OUT/; cp /tmp/s3c/*.json $OUT/ 2>/dev/null; tail -5 /tmp/s3c/*executor*.log > $OUT/s3c_executor_tail.log 2>&1
echo quit | nvidia-cuda-mps-control
