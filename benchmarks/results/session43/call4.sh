. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name" >> $OUT/gpu.txt
# S4 in both orders (call 4; was planned as call 3) (session 42's baseline fleet always ran first, on a fresh executor, and slow)
cd benchmarks && timeout -s INT 360 python3 s4_mixed.py --model llama-1b --seconds 8 --rounds 2 --out $OUT/s4 --tag s43 > $OUT/s4.log 2>&1; echo rc=$? >> $OUT/s4.log; cd ..
tails $OUT/s4 >> $OUT/s4.log
# what tenant 0's main thread does at N = 16, native frames included (session 42: 84% "its own work")
cd benchmarks && timeout -s INT 150 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --py-spy 16 --py-spy-native --out $OUT/s3spy --tag s43native > $OUT/s3spy.log 2>&1; echo rc=$? >> $OUT/s3spy.log; cd ..
tails $OUT/s3spy >> $OUT/s3spy.log
echo quit | nvidia-cuda-mps-control
