. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in sessions 51-52: S9 at N = 16 (issue 21's goal: hosted >= 1.3x the same tenants holding their adapters) with
# eager step graphs (step_graphs=True, exact), where a private tenant's LoRA is PEFT's own kernels in its graph (~8
# GEMMs a layer and their elementwise work), against the hosted tenants in gangs (two kernels a place a round).
# Session 51 with compiled steps: hosted 0.92x private (a compiled tenant's LoRA is fused into kernels it runs anyway).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s9_hosted.py --model llama-1b --ns 16 --registered 100 --seconds 8 --out $d --tag s53s9 \
  --max-processes 16 --tenant-flags="--step-graphs" > $d/s9.log 2>&1; echo rc=$? >> $d/s9.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent\|FutureWarning\|warnings.warn" $d/s9.log | tail -30 > $OUT/s9.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
