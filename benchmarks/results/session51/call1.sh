. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 51, call 1 (session 50's planned_next.sh). (1) What session 50 changed after its
# last call, on the GPU (~3 min): the gang LoRA kernel in float32 and bfloat16 (its shrink now over 4 programs a row),
# four hosted tenants in gangs (a gang keeps no adapter in its calls now), step graphs with fused handovers
# (graph_words.put/take, their PTX fences: bitwise the eager tenant). (2) S9 at N = 16 with step graphs compiled for every tenant: hosted adapters now ride in gangs; the goal is
# hosted >= 1.3x private (session 46: 1.19x, both without step graphs).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 250 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short -s \
  -k "gang_lora or hosted_adapters_of_four or step_graphs_decode and handover" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 320 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --seconds 8 --out $d --tag s51 \
  --tenant-flags="--step-graphs --compiled-steps" > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent\|FutureWarning\|warnings.warn" $d/s9.log | tail -30 > $OUT/s9.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
