"""The GPU's SM clock, power draw and power-cap state while a timed region runs
(``nvidia-smi`` sampled in the background).

Why: kernel benchmarks time a route for tens of milliseconds, an engine keeps the GPU busy
for seconds. At 128 heads and three query tokens a request the decode kernels are bound by
their math (run 217: ~750 us a layer, 24 layers a step), where the board's power limit can
lower the SM clock, and by how much may differ between two kernels doing the same work. A
timing with the clock beside it tells a slower kernel from a slower clock.

Usage::

    with ClockSampler() as clocks:
        ...  # the timed region
    print(clocks.summary.brief() if clocks.summary else "no nvidia-smi")

Without ``nvidia-smi`` (or where it refuses every field set) the sampler records nothing
and ``summary`` is ``None``; the timed region runs either way.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from typing import ClassVar

#: Field sets tried in order: drivers from 535 name the clock-limiting reasons
#: ``clocks_event_reasons``, older ones ``clocks_throttle_reasons``; the last set has none.
BASE_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown")
FIELD_SETS = (
    BASE_FIELDS + tuple(f"clocks_event_reasons.{r}" for r in REASONS),
    BASE_FIELDS + tuple(f"clocks_throttle_reasons.{r}" for r in REASONS),
    BASE_FIELDS,
)


@dataclass(frozen=True)
class Sample:
    """One ``nvidia-smi`` reading; ``None`` where it printed ``[N/A]`` or nothing."""

    sm_mhz: float | None
    power_w: float | None
    temp_c: float | None
    power_capped: bool | None = None
    slowdown: bool | None = None


@dataclass(frozen=True)
class ClockSummary:
    """Samples of one timed region: medians, extremes, and the share of samples in which
    the software power cap (``power_capped``) or a hardware or thermal slowdown limited the
    clock (``None`` where the driver did not report the reason)."""

    samples: int
    sm_mhz: float
    sm_mhz_min: float
    power_w: float | None
    power_w_max: float | None
    temp_c_max: float | None
    power_capped: float | None
    slowdown: float | None

    def brief(self) -> str:
        text = f"SM {self.sm_mhz:.0f} MHz (min {self.sm_mhz_min:.0f})"
        if self.power_w is not None:
            text += f", {self.power_w:.0f} W (max {self.power_w_max:.0f})"
        if self.power_capped is not None:
            text += f", power-capped {self.power_capped:.0%}"
        if self.slowdown:
            text += f", slowdown {self.slowdown:.0%}"
        return text + f", {self.samples} samples"

    def columns(self, prefix: str = "") -> dict[str, str]:
        """CSV columns: ``sm_mhz``, ``power_w``, ``power_capped`` (share of samples)."""
        return {f"{prefix}sm_mhz": f"{self.sm_mhz:.0f}",
                f"{prefix}power_w": "" if self.power_w is None else f"{self.power_w:.0f}",
                f"{prefix}power_capped": ("" if self.power_capped is None
                                          else f"{self.power_capped:.2f}")}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _active(text: str) -> bool | None:
    text = text.strip().lower()
    if text in ("active", "not active"):
        return text == "active"
    return None


def parse_samples(text: str, fields: tuple[str, ...]) -> list[Sample]:
    """``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` output -> samples;
    lines without a readable SM clock (a partial last line, a message) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) != len(fields):
            continue
        values = dict(zip(fields, (v.strip() for v in parts), strict=True))
        sm = _number(values["clocks.sm"])
        if sm is None:
            continue
        reason = {k.rsplit(".", 1)[1]: _active(v) for k, v in values.items()
                  if "_reasons." in k}
        others = [v for k, v in reason.items() if k != "sw_power_cap"]
        samples.append(Sample(
            sm_mhz=sm, power_w=_number(values["power.draw"]),
            temp_c=_number(values["temperature.gpu"]), power_capped=reason.get("sw_power_cap"),
            slowdown=None if not others or None in others else any(others)))
    return samples


def _share(flags: list[bool | None]) -> float | None:
    if not flags or None in flags:
        return None
    return sum(flags) / len(flags)


def summarize(samples: list[Sample]) -> ClockSummary | None:
    """The samples' medians and extremes; ``None`` without a sample."""
    sm = [s.sm_mhz for s in samples if s.sm_mhz is not None]
    if not sm:
        return None
    power = [s.power_w for s in samples if s.power_w is not None]
    temp = [s.temp_c for s in samples if s.temp_c is not None]
    return ClockSummary(
        samples=len(sm), sm_mhz=statistics.median(sm), sm_mhz_min=min(sm),
        power_w=statistics.median(power) if power else None,
        power_w_max=max(power) if power else None, temp_c_max=max(temp) if temp else None,
        power_capped=_share([s.power_capped for s in samples]),
        slowdown=_share([s.slowdown for s in samples]))


def gpu_id() -> str:
    """The ``nvidia-smi`` index of the GPU this process uses first (``CUDA_VISIBLE_DEVICES``'
    first entry, else 0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def working_fields(smi: str, gpu: str) -> tuple[str, ...] | None:
    """The first of ``FIELD_SETS`` this driver answers, or ``None``."""
    for fields in FIELD_SETS:
        try:
            subprocess.run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader",
                            f"--id={gpu}"], capture_output=True, timeout=20, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        return fields
    return None


class ClockSampler:
    """Samples the GPU every ``interval_ms`` from ``__enter__`` to ``__exit__`` (an
    ``nvidia-smi`` loop in its own process); then ``samples`` and ``summary``. Fields are
    probed once per process (``working_fields``)."""

    _fields: ClassVar[dict[tuple[str, str], tuple[str, ...] | None]] = {}

    def __init__(self, interval_ms: int = 100, gpu: str | None = None) -> None:
        self.interval_ms = interval_ms
        self.gpu = gpu if gpu is not None else gpu_id()
        self.samples: list[Sample] = []
        self._proc: subprocess.Popen | None = None
        self._fields_used: tuple[str, ...] | None = None

    def __enter__(self) -> ClockSampler:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        key = (smi, self.gpu)
        if key not in ClockSampler._fields:
            ClockSampler._fields[key] = working_fields(smi, self.gpu)
        self._fields_used = ClockSampler._fields[key]
        if self._fields_used is None:
            return self
        self._proc = subprocess.Popen(
            [smi, f"--query-gpu={','.join(self._fields_used)}",
             "--format=csv,noheader,nounits", f"--id={self.gpu}",
             f"--loop-ms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = parse_samples(out or "", self._fields_used or ())
        self._proc = None

    @property
    def summary(self) -> ClockSummary | None:
        return summarize(self.samples)
