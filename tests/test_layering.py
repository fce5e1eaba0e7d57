"""The ops layer runs where vLLM is absent (the GPU machine): importing it, planning and
running the reference route pull in neither vLLM nor any kernel package."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_ops_import_and_cpu_decode_load_no_engine_and_no_kernel_package():
    code = textwrap.dedent("""
        import sys, torch
        from trtllm_mla_plugin.ops import mla_decode
        q = torch.randn(2, 4, 40)
        kv = torch.randn(6, 4, 40)
        bt = torch.arange(6, dtype=torch.int32).view(2, 3)
        lens = torch.tensor([5, 12], dtype=torch.int32)
        mla_decode(q, kv, bt, lens, 0.1, 32, max_seq_len=12)
        print("LOADED", sorted({m.split(".")[0] for m in sys.modules}
                               & {"vllm", "flashinfer", "triton"}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout
