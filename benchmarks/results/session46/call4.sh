. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the one GPU test calls 1 and 3 did not finish: four fine-tuning tenants under --gpu-batches (the device budget's last ~250 s)
timeout -s INT 185 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 180 -rfE --tb=short --durations=0 -k "four_fine and batches" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
