. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|MHz" >> $OUT/gpu.txt
# how many CUDA processes MPS takes on this GPU, by CUDA_DEVICE_MAX_CONNECTIONS (S3/S9 at N = 64 did not start)
timeout -s INT 130 python3 benchmarks/probes/mps_clients.py --processes 64 --connections default,2,1 > $OUT/mps_clients.log 2>&1; echo rc=$? >> $OUT/mps_clients.log
# S2 K = 8 with the executor's 5 ms spin (default since d11f513) against 200 us, 8 processes beside them
cd benchmarks && timeout -s INT 330 python3 s2_finetune.py --model llama-1b --ks 8 --max-processes 8 --seconds 10 --executors "spin5000=;spin200=--spin-us 200" --out $OUT/s2 --tag s42 > $OUT/s2.log 2>&1; echo rc=$? >> $OUT/s2.log; cd ..
tails $OUT/s2 >> $OUT/s2.log
echo quit | nvidia-cuda-mps-control
