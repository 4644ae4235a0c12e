. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; lscpu | grep "Model name" >> $OUT/gpu.txt
# issue 21: S9 N = 16, 100 registered adapters (q,v, ranks 8-128, Zipf 1.0): hosted against private, twice (two executors of the same flags)
d=/tmp/r/s9; mkdir -p $d
cd benchmarks && timeout -s INT 390 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --max-processes 0 --seconds 8 --out $d --tag s46 \
  --executors "run1=--adapter-pool-mb 1024;run2=--adapter-pool-mb 1024" > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log; cd ..
{ grep -v "^  \|^Traceback\|^KeyboardInterrupt" $d/s9.log | tail -30; for e in $d/executor*.log; do echo "#### $e"; grep -v "attached;\|detached\|mailboxes of\|hosted adapter" $e | tail -5; done; } > $OUT/s9.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
# the GPU test call 1 did not finish (four fine-tuning tenants [gpu-batches]), with what time is left
left=$(( 560 - SECONDS ))
if [ $left -gt 60 ]; then timeout -s INT $left python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 190 -rfE --tb=short --durations=0 -k "four_fine and gpu" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; else echo "no time left ($left s)" > $OUT/gpu_tests.txt; fi
echo quit | nvidia-cuda-mps-control
