. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 52, call 1 (planned in session 51). (1) What session 51 built after its
# last call, on the GPU: the gang test with one-warp word waits on both sides (serve --spin-warps 1,
# graph_words.SPIN_WARPS) and compiled steps whose prefills run compiled too (StepGraphs.compiled_prefill). (2) S3 at
# N = 16: the processes and the compiled-step tenants as they are; then an executor and tenants whose word waits are
# one warp. Why first: every word wait spins on a word in page-locked host memory, across PCIe, with 4 warps (16
# tenants and 4 lanes at once), and fused handovers, whose waits spin with 16 warps, ran at 0.26x (session 51, call 3):
# the polling may be what the handovers queue behind. If one warp wins, make it the default on both sides.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 220 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 200 -rfE --tb=short -s \
  -k "fused-spin1 or compiled-prefill" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 230 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s52a --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3a.log 2>&1
echo rc=$? >> $d/s3a.log
timeout -s INT 120 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s52s --executors "spin1=--spin-warps 1" --tenant-flags "spin1=--step-graphs --compiled-steps --spin-warps 1" > $d/s3b.log 2>&1
echo rc=$? >> $d/s3b.log; cd ..
for f in s3a s3b; do grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/$f.log | tail -40 > $OUT/$f.txt 2>&1; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
