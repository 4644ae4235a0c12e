. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the GPU tests, first half (file order 1-17): the two-tenant test and the native-lane case of call_taken_before not run since session 44's fixes; pytest-timeout fails a hung test after 150 s and goes on
timeout -s INT 560 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short -k "cuda_executor_cpu_tenant_parity or cuda_executor_bfloat16 or same_gpu_tenant_parity or layer_spans or calls_that_wait or two_same_gpu or native_call_path or graph_replays or two_placements or same_gpu_tenant_killed_mid_call or page_locked or stalled_input or call_taken_before or held_behind or failed_call or synchronise_inside or thread_without_cuda" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
