. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
L=q_proj,k_proj,v_proj,o_proj
timeout -s INT 130 python benchmarks/probes/span_decode.py --model llama-1b --device cuda:0 --lora $L --rounds 300 > $OUT/span_decode.log 2>&1; echo rc=$? >> $OUT/span_decode.log
timeout -s INT 110 python benchmarks/probes/span_decode.py --model llama-1b --device cuda:0 --lora $L --rounds 100 --profile > $OUT/span_decode_profile.log 2>&1; echo rc=$? >> $OUT/span_decode_profile.log
cd benchmarks
timeout -s INT 180 python3 s1_split_tax.py --model llama-1b --steps 8 --new-tokens 32 --scenarios decode --compare-layer-spans --out /tmp/s1 > $OUT/s1.log 2>&1; echo rc=$? >> $OUT/s1.log
cp /tmp/s1/*.json $OUT/ 2>/dev/null
cd ..
OMP_WAIT_POLICY=PASSIVE timeout -s INT 130 python benchmarks/probes/mask_against.py --against noise-ahead --against-file benchmarks/probes/privacy_ahead.py --device cuda:0 --tokens 1,16,64 > $OUT/mask.log 2>&1; echo rc=$? >> $OUT/mask.log
echo quit | nvidia-cuda-mps-control
