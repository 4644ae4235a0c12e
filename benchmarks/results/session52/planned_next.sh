. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 52 (its device time spent): the next session's first call. (1) benchmarks/probes/polling_pressure.py:
# do programs spinning on words in host memory slow other work on the GPU (a graph's kernel chain, GEMVs, host copies,
# handoffs), and do naps between looks or words in device memory help? (Session 52: one-warp waits gave S3 1.36x.)
# If device words win clearly, move the program words into the executor's device mailbox (docs/gpu.md says how far).
# (2) The gang test at this session's gang word kernels (call 3 cut it at 130 s, before its token comparisons).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 240 python3 benchmarks/probes/polling_pressure.py --spinners 0,16,64 \
  --kinds host-w4,host-w1,host-w1-nap500,host-w1-nap2000,device-w1 --out $OUT/polling.json > $OUT/polling.txt 2>&1
echo rc=$? >> $OUT/polling.txt
timeout -s INT 260 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 250 -rfE --tb=short -s \
  -k "step_programs_of_four_tenants_run_in_gangs and (fused-steps or fused-spin4)" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
