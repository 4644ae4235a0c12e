. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name" >> $OUT/gpu.txt
# the chunked loss on a GPU: bitwise against transformers' loss, and its peak (V = 128,256 and 50,257)
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_loss.py > $OUT/test_loss.log 2>&1; echo rc=$? >> $OUT/test_loss.log
# S2 K = 8: tenants with the chunked loss (default since acb3dd8) / with transformers' loss, both orders, 8 processes beside them
cd benchmarks && timeout -s INT 360 python3 s2_finetune.py --model llama-1b --ks 8 --max-processes 8 --seconds 8 --tenant-flags "chunked=;transformers=--transformers-loss" --rounds 2 --out $OUT/s2 --tag s43 > $OUT/s2.log 2>&1; echo rc=$? >> $OUT/s2.log; cd ..
tails $OUT/s2 >> $OUT/s2.log
# do same-GPU word handoffs slow down while other processes' streams wait on words?
timeout -s INT 80 python3 benchmarks/probes/blocked_streams.py --blocked 0,16,64 > $OUT/blocked_streams.log 2>&1; echo rc=$? >> $OUT/blocked_streams.log
echo quit | nvidia-cuda-mps-control
