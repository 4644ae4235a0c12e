. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 51: S3 N = 16 with SDPA never on cuDNN's kernel (fleet_worker --no-cudnn-attention), on both
# sides (the processes' attention too: a fair baseline). Session 51's profile: a compiled-step tenant's cuDNN decode
# attention took 28 us a layer, with ~3.4 layout kernels beside it, ~25% of its own kernel time. If it wins, make
# the compiled step choose the backend (client/step_graphs.py), with its exactness test.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 560 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s52n --process-flags "eager=;nocudnn=--no-cudnn-attention" \
  --tenant-flags "cgraphs=--step-graphs --compiled-steps;nocudnn=--step-graphs --compiled-steps --no-cudnn-attention" > $d/s3.log 2>&1
echo rc=$? >> $d/s3.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/s3.log | tail -40 > $OUT/s3.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
