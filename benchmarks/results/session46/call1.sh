. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; lscpu | grep "Model name" >> $OUT/gpu.txt
# issue 20, run 1 of 2: masked / plain over loopback gRPC on a GPU host at c5957e4's masking (a small call's float32 copy takes the noise in place)
OMP_WAIT_POLICY=PASSIVE timeout -s INT 80 python3 benchmarks/probes/mask_overhead.py --device cuda:0 --tokens 1,16,1024,4096 2>&1 | grep -v "Writing model" > $OUT/mask.txt; echo rc=$? >> $OUT/mask.txt
# the GPU tests session 45 fixed code under after its runs or did not reach, with their durations
pt() { left=$(( 545 - SECONDS )); [ $left -gt 20 ] || { echo "no time left for: $1" >> $OUT/gpu_tests.txt; return; }
  echo "## -k $1 (limit ${left}s)" >> $OUT/gpu_tests.txt
  timeout -s INT $left python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short --durations=0 -k "$1" >> $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; }
pt "trains_after or two_same_gpu or native_call_path or call_taken_before or grpc"
pt "four_fine and not default"
echo quit | nvidia-cuda-mps-control
