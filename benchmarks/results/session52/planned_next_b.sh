. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in session 52: S3's latency goal in one run (a lone tenant and 16, the processes beside them: session 52's
# ratio, ~3.1x, was across calls), then an executor with the program words in device memory (serve --device-words;
# only if planned_next.sh's gang test passed with them), then one whose word waits nap 500 ns between looks (if the
# probe found naps help; else drop it).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 330 python3 s3_inference.py --model llama-1b --ns 1,16 --max-processes 16 --mixed none --seconds 8 --out $d \
  --tag s53a --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3a.log 2>&1
echo rc=$? >> $d/s3a.log
timeout -s INT 125 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s53d --executors "dwords=--device-words" --tenant-flags "cgraphs=--step-graphs --compiled-steps" > $d/s3b.log 2>&1
echo rc=$? >> $d/s3b.log
timeout -s INT 125 python3 s3_inference.py --model llama-1b --ns 16 --max-processes 0 --mixed none --seconds 8 --out $d \
  --tag s53n --executors "nap500=--spin-nap-ns 500" --tenant-flags "nap500=--step-graphs --compiled-steps --spin-nap-ns 500" > $d/s3c.log 2>&1
echo rc=$? >> $d/s3c.log; cd ..
for f in s3a s3b s3c; do grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|Assertion .index\|CUDAEvent" $d/$f.log | tail -40 > $OUT/$f.txt 2>&1; done
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
