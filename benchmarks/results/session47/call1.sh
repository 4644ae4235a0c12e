. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
# session 47, call 1: (1) a decoding tenant's whole step as one CUDA graph, feasibility (probes/graphed_step.py:
# words captured in a graph; transformers' Llama decode step with a StaticCache captured eagerly);
# (2) the GPU tests over the local transport's join changes of caad9f4 / 2a50b6f (planned in session 46)
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 150 python3 benchmarks/probes/graphed_step.py --model llama-1b --json $OUT/graphed_step.json > $OUT/graphed_step.txt 2>&1; echo rc=$? >> $OUT/graphed_step.txt
left=$(( 570 - SECONDS ))
timeout -s INT $left python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 150 -rfE --tb=short --durations=0 \
  -k "two_same_gpu or native_call_path or call_taken_before or held_behind or grows or parked or killed" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
echo quit | nvidia-cuda-mps-control
