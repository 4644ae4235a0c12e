. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 45 (no device time left): the GPU tests it did not reach or changed code under after its runs
# (ids bounds outside inference mode; _deciding around a call's look at _early(); --max-tenants), with their durations
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout -s INT 540 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short --durations=0 \
  -k "trains_after or two_same_gpu or native_call_path or call_taken_before or grpc or (four_fine and not default)" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
