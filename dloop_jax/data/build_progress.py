"""Progress of a `target_responses` build on stderr: prompts done, tokens/s, ETA."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from dloop_jax.data.target_responses_config import NAME


class Progress:
  """Prompts done / total, generated tokens per second and ETA, to stderr."""

  def __init__(self, *, total: int, done: int, stream: TextIO | None = None,
               every_seconds: float = 2.0, enabled: bool = True):
    self.total, self.done, self.start_done = total, done, done
    self.new_tokens = 0
    self.read_tokens = 0  # tokens of stored answers read by a features forward
    self.stream = stream if stream is not None else sys.stderr
    self.every = every_seconds
    self.enabled = enabled
    self.t0 = time.perf_counter()
    self._last = -math.inf

  def update(self, *, prompts: int, new_tokens: int, read_tokens: int = 0,
             force: bool = False) -> None:
    self.done += prompts
    self.new_tokens += new_tokens
    self.read_tokens += read_tokens
    now = time.perf_counter()
    if self.enabled and (force or now - self._last >= self.every or self.done == self.total):
      self._last = now
      print(self.line(now), file=self.stream, flush=True)

  def line(self, now: float | None = None) -> str:
    elapsed = (now or time.perf_counter()) - self.t0
    generated = self.done - self.start_done
    rate = self.new_tokens / elapsed if elapsed > 0 else 0.0
    if generated and self.done < self.total:
      eta = _duration(elapsed / generated * (self.total - self.done))
    else:
      eta = "0s" if self.done >= self.total else "?"
    pct = 100.0 * self.done / max(self.total, 1)
    read = (f" | {self.read_tokens / elapsed:,.0f} tok/s of stored answers read"
            if self.read_tokens and elapsed > 0 else "")
    return (f"[{NAME}] {self.done}/{self.total} prompts ({pct:.0f}%) | {rate:,.1f} new tok/s"
            f"{read} | elapsed {_duration(elapsed)} | ETA {eta}")


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")

