. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
cd benchmarks
timeout -s INT 170 python3 s3_inference.py --model llama-1b --ns 32 --max-processes 0 --mixed none --seconds 8 --tag s35_n32 --out /tmp/s3 > $OUT/s3.log 2>&1; echo rc=$? >> $OUT/s3.log
echo quit | nvidia-cuda-mps-control
