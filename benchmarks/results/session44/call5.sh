. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# the rest of the GPU tests (call 3 ran the first 15: the parity tests and the new one, all passed)
timeout 540 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "not cpu_tenant_parity and not test_cuda_executor_bfloat16 and not test_same_gpu_tenant_parity and not layer_spans" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
