. benchmarks/gpu_host_setup.sh; export PYTHONFAULTHANDLER=1
timeout -s ABRT 300 python3 -m pytest -m gpu -v -o faulthandler_timeout=120 tests/test_gpu.py -k "held_behind or stalled_input or taken_before_its_input or ids_out_of_range or native_call_path or compiled_generate or killed_while_the_gpu_waits" > /tmp/gputests.log 2>&1; echo rc=$? >> /tmp/gputests.log
grep -v "^  File\|^    \|^Extension" /tmp/gputests.log | tail -40 > $OUT/gputests_tail.log
cd benchmarks
timeout -s INT 270 python3 s4_mixed.py --model llama-1b --seconds 8 --train-mps-threads ",25,50" --tag s37 --out /tmp/s4 > $OUT/s4.log 2>&1; echo rc=$? >> $OUT/s4.log
cp /tmp/s4/*.json /tmp/s4/*summary* $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
