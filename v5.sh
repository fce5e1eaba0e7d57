bash .vk2/vllm-kit-install.sh 2 > /tmp/kit2.log 2>&1; echo kit2 rc $?; tail -1 /tmp/kit2.log
export PYTHONPATH=$PWD:/tmp/kit/plugin:/tmp/kit/vllm:/tmp/kit/site:$PWD/benchmarks VLLM_USE_FLASHINFER_SAMPLER=0
R=/tmp/r159; mkdir -p $R
timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_decode_routes_gpu.py tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_reliability_gpu.py tests/gpu/test_flashmla_schedule_gpu.py tests/gpu/test_splitk_gpu.py > $R/suite.log 2>&1; echo suite rc $?; tail -3 $R/suite.log; grep FAILED $R/suite.log | head
tar czf $OUT/run159.tgz -C $R .
