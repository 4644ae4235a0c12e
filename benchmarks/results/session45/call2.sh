. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
# the GPU tests, second half (file order 18-35)
timeout -s INT 560 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short -k "compiled_generate or two_streams or killed_while or parked or peer_gpu or grows or attaching_before or executor_killed or skeleton or big_calls or meet_in or four_fine or grpc or host_waits or ids_out_of_range or bad_ids or trains_after" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
