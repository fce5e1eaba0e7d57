"""A decoder's ``plan`` must not wait for the GPU.

In the engine ``plan`` runs on the host while the GPU still executes the previous step's
graph; a plan that waits for those kernels (a device-to-host copy, a synchronising call)
leaves the GPU idle while the host builds the rest of the next step. Here the GPU is kept
busy for about ``BUSY_S`` with ``torch.cuda._sleep`` and the host time of the call must
stay far below it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder
from trtllm_mla_plugin.ops.routes.base import copy_from_host
from trtllm_mla_plugin.ops.routes.flashinfer_mla import paged_csr
from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import graph_replan

from mla_cases import GPU_TEST_MARKS, make_problem, route_skip_reason, with_host_lengths

pytestmark = GPU_TEST_MARKS

#: How long the GPU is kept busy before the timed call (an H200 step is 1-10 ms; this is
#: long enough that waiting for it cannot hide in the host's own time).
BUSY_S = 0.2
#: The most host time a call that does not wait may take (its own work is 0.01-1 ms).
NO_WAIT_S = 0.05


def host_seconds_while_busy(call) -> float:
    """Host seconds of ``call()`` issued while the GPU sleeps ``BUSY_S`` (after one warm-up
    call, so allocator caches and lazy initialisation are out of the timing)."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(BUSY_S * 1.98e9))  # cycles at the H200's ~1.98 GHz SM clock
    start = time.perf_counter()
    call()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took


def test_copy_from_host_does_not_wait_for_the_gpu():
    dst = torch.zeros(1024, dtype=torch.int64, device="cuda")
    src = np.arange(1024, dtype=np.int64)
    took = host_seconds_while_busy(lambda: copy_from_host(dst, src))
    print(f"[host copy, GPU busy {BUSY_S * 1e3:.0f} ms] {took * 1e3:.3f} ms")
    assert took < NO_WAIT_S
    assert torch.equal(dst.cpu(), torch.from_numpy(src))


@pytest.mark.parametrize("device_plan", [False, True], ids=["host-plan", "gpu-plan"])
def test_vllm_fa3_graph_plan_does_not_wait_for_the_gpu(device_plan):
    """The route's plan on a batch it launches longest first with its own KV splits (128
    requests of 32 query rows over 2.4-4.8k tokens: both host arrays are copied; or the
    length order and splits computed on the GPU, ``policy.VLLM_FA3_DEVICE_PLAN``)."""
    device = torch.device("cuda")
    lens = [4800, 2400] * 64
    p = make_problem(heads=32, block=64, lens=lens, q_lens=1, dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16, device=device, width=max(lens) // 64 + 1,
                     spec_q_len=1)
    if (reason := route_skip_reason("vllm-fa3-mla", p.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(p.spec, device, max_batch_size=len(lens), route="vllm-fa3-mla",
                         cuda_graph=True)
    batch = with_host_lengths(p.batch)
    route = decoder.route
    route.device_plan_override = device_plan
    took = host_seconds_while_busy(lambda: decoder.plan(batch))
    lens_host = -np.sort(-np.asarray(lens))
    assert route._ordered
    assert graph_replan(route.spec, 1, lens_host, route._reserved_splits,
                        route._planned_splits, route._sms) is not None
    print(f"[vllm-fa3-mla plan, h32 b128, {'GPU plan' if device_plan else 'host plan'}, "
          f"GPU busy {BUSY_S * 1e3:.0f} ms] "
          f"{took * 1e3:.3f} ms")
    assert took < NO_WAIT_S


def test_paged_csr_does_not_wait_for_the_gpu():
    """FlashInfer routes' CSR page list (eager decoders) from host lengths: its host-to-
    device copies go through ``to_device``."""
    lens = torch.randint(1, 9000, (256,), dtype=torch.int32)
    table = torch.randint(0, 50_000, (256, 160), dtype=torch.int32, device="cuda")
    took = host_seconds_while_busy(lambda: paged_csr(table, lens, 64))
    print(f"[paged_csr b256, GPU busy {BUSY_S * 1e3:.0f} ms] {took * 1e3:.3f} ms")
    assert took < NO_WAIT_S
