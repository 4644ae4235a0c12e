. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the fused loss after its review fixes (the label check, -inf rows, contiguous target), at bf16/f16/f32 on a GPU
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_loss.py > $OUT/test_loss.log 2>&1; echo rc=$? >> $OUT/test_loss.log
timeout -s INT 60 python3 benchmarks/probes/loss_memory.py --device cuda > $OUT/loss_memory.log 2>&1; echo rc=$? >> $OUT/loss_memory.log
echo quit | nvidia-cuda-mps-control
