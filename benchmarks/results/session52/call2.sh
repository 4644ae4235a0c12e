. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# Session 52, call 2, after one-warp word waits became the default on both sides (call 1: S3 N = 16 at 1,893.7
# tokens/s against 1,393.2 with four warps). (1) The fused handovers' GPU test now that `take` spins with one warp.
# (2) A lone compiled-step tenant (the latency goal's denominator) at the new default. (3) 16 of them on one
# executor: as they are; with fused handovers (two kernels a call; 0.26x when take spun with 16 warps); at MPS's
# below-normal client priority (the executor's rounds, on every member's path, go first); with SDPA off cuDNN.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 110 -rfE --tb=short -s \
  -k "decode_as_the_eager_tenant_does and handover" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 70 python3 s3_inference.py --model llama-1b --ns 1 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s52l --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3l.log 2>&1
echo rc=$? >> $d/s3l.log
timeout -s INT 380 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d --tag s52v \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;fused=--step-graphs --compiled-steps --fused-handover;low=--step-graphs --compiled-steps --mps-priority 1;nocudnn=--step-graphs --compiled-steps --no-cudnn-attention" > $d/s3v.log 2>&1
echo rc=$? >> $d/s3v.log
cd ..
for f in s3l s3v; do grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/$f.log | tail -40 > $OUT/$f.txt 2>&1; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
