. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 52 (its device time spent): the next session's first call. (1) benchmarks/probes/polling_pressure.py:
# do programs spinning on words in host memory slow other work on the GPU (a graph's kernel chain, GEMVs, host copies,
# handoffs), and do naps between looks or words in device memory help? (Session 52: one-warp waits gave S3 1.36x.)
# (2) First, the tests: the gang test at session 52's gang word kernels (call 3 cut it at 130 s, before its token
# comparisons), and with the program words in device memory (serve --device-words, built in session 52, never run on
# a GPU), and fused handovers (put's stores in a loop); session 52's default-path changes not GPU-run (a region
# zeroed on a stream of its own, define_program under the lock) run in all of them.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 360 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short -s \
  -k "(step_programs_of_four_tenants_run_in_gangs and (fused-steps or fused-device-words)) or (decode_as_the_eager_tenant_does and handover)" \
  > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt
timeout -s INT 190 python3 benchmarks/probes/polling_pressure.py --spinners 0,16,64 \
  --kinds host-w4,host-w1,host-w1-nap500,device-w1 --out $OUT/polling.json > $OUT/polling.txt 2>&1
echo rc=$? >> $OUT/polling.txt
cp ${TMPDIR:-/tmp}/test-*.log $OUT/ 2>/dev/null; ls $OUT/test-*.log 2>/dev/null | tail -n +5 | xargs -r rm
echo quit | nvidia-cuda-mps-control
