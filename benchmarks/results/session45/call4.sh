. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
# the GPU tests calls 1-2 did not reach (the device budget's last call), the half-1 ones first (call_taken_before's native case failed in session 44)
pt() { left=$(( 530 - SECONDS )); [ $left -gt 20 ] || { echo "no time left for: $1" >> $OUT/gpu_tests.txt; return; }
  echo "## -k $1 (limit ${left}s)" >> $OUT/gpu_tests.txt
  timeout -s INT $left python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short -k "$1" >> $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; }
pt "call_taken_before or held_behind or failed_call or synchronise_inside or thread_without_cuda"
# issue 20: masked / plain over loopback gRPC on a GPU host at the current masking (the noise scale as the GEMMs' alpha)
OMP_WAIT_POLICY=PASSIVE timeout -s INT 80 python3 benchmarks/probes/mask_overhead.py --device cuda:0 --tokens 1,16,1024,4096 2>&1 | grep -v "Writing model" > $OUT/mask.txt; echo rc=$? >> $OUT/mask.txt
pt "grpc or trains_after or bad_ids"
pt "host_waits or ids_out_of_range"
pt "four_fine and not default"
echo quit | nvidia-cuda-mps-control
