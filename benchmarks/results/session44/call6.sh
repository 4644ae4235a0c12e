. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# the GPU tests after return_early became "alone among this executor's tenants in the process" (call 5: 4 failed where a test's second tenant, or one left over by an earlier test, turned it off)
timeout 560 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "two_same_gpu or native or held_behind or failed_call or synchronise_inside or two_streams or killed_while or parked or grows or attaching_before or executor_killed or skeleton or big_calls or meet_in or four_fine or grpc or host_waits or ids or trains_after" -rfE --tb=short > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
