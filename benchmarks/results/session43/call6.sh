. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the GPU loss tests with call 5's tolerances fixed (float16 subnormals; float32's peak)
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_loss.py > $OUT/test_loss.log 2>&1; echo rc=$? >> $OUT/test_loss.log
echo quit | nvidia-cuda-mps-control
