bash .vk2/vllm-kit-install.sh 2 > /tmp/kit2.log 2>&1; echo kit2 rc $?; tail -1 /tmp/kit2.log
export PYTHONPATH=$PWD:/tmp/kit/plugin:/tmp/kit/vllm:/tmp/kit/site:$PWD/benchmarks VLLM_USE_FLASHINFER_SAMPLER=0
R=/tmp/r159; mkdir -p $R
timeout 470 python3 benchmarks/bench_engine.py --heads 128 --output-len 336 --short-len 16 --repeats 2 \
   --layers 24 --timeout 240 --no-warmup-engine --paired --kv auto --rounds 3 \
   --out $R/fm --batches 128 --backends TRTLLM_MLA,FLASHMLA > $R/engine.log 2>&1; echo engine rc $?
grep -v "Writing model" $R/engine.log | tail -12
tar czf $OUT/run159.tgz -C $R .
