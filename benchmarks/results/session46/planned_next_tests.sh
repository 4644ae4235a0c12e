. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# NOT RUN in session 46 (no device time left): the GPU tests over the local transport's join changes of caad9f4 / 2a50b6f
# (a second look after a grow, the narrower deciding window, a join cut short finished by the next call), with their durations
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout -s INT 540 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short --durations=0 \
  -k "two_same_gpu or native_call_path or call_taken_before or held_behind or grows or parked or killed" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
