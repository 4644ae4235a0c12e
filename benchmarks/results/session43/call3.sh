. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
tails() { for f in $1/executor*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name" >> $OUT/gpu.txt
# the fused loss (client/fused_loss.py) on a GPU: within rounding of transformers', its peak below the chunks'
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_loss.py > $OUT/test_loss.log 2>&1; echo rc=$? >> $OUT/test_loss.log
# each loss's peak and time over S2's logits (2 x 512 x 128,256 bf16), alone on the GPU
timeout -s INT 90 python3 benchmarks/probes/loss_memory.py --device cuda > $OUT/loss_memory.log 2>&1; echo rc=$? >> $OUT/loss_memory.log
# S2 K = 8: tenants with the fused loss (default now) / transformers' loss, both orders, 8 processes beside them
cd benchmarks && timeout -s INT 360 python3 s2_finetune.py --model llama-1b --ks 8 --max-processes 8 --seconds 8 --tenant-flags "fused=;transformers=--lm-loss transformers" --rounds 2 --out $OUT/s2 --tag s43fused > $OUT/s2.log 2>&1; echo rc=$? >> $OUT/s2.log; cd ..
tails $OUT/s2 >> $OUT/s2.log
echo quit | nvidia-cuda-mps-control
