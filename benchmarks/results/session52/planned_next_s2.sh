. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1
# NOT RUN in sessions 50-52: S2 at K = 8 (llama-1b, 2 x 512 tokens a step, LoRA q,v ranks 8-64) with every fine-tuning
# tenant's forward and backward compiled by torch.compile (fleet_worker --compile-train; their calls counted as
# training since session 50), beside the processes as users run them and compiled: what compiling gives each side
# (S3's lever was the tenants' own launches; S2's goal is 1.5x the processes at <= 0.5x their memory).
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
d=/tmp/r/g; mkdir -p $d
cd benchmarks && timeout -s INT 585 python3 s2_finetune.py --model llama-1b --ks 8 --max-processes 8 --seconds 12 --out $d \
  --tag s53t --process-flags "eager=;compiled=--compile-train default" \
  --tenant-flags "eager=;compiled=--compile-train default" > $d/s2.log 2>&1
echo rc=$? >> $d/s2.log; cd ..
grep -v "^  \|^Traceback\|^KeyboardInterrupt\|UserWarning\|FutureWarning\|warnings.warn" $d/s2.log | tail -30 > $OUT/s2.txt 2>&1
cp $d/*.json $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
