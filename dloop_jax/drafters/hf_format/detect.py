"""Which public layout a drafter directory holds, from its config.json."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dloop_jax.drafters.hf_format import dflash
from dloop_jax.drafters.hf_format import domino
from dloop_jax.drafters.hf_format import dspark
from dloop_jax.drafters.hf_format import eagle3
from dloop_jax.errors import CheckpointFormatError

KINDS = ("eagle3", "dflash", "dspark", "domino")
_SUPPORTED = "EAGLE-3, DFlash, DSpark and Domino drafters"

# Public layouts we recognise but cannot represent, and why.
_UNSUPPORTED = {
    "Qwen3Eagle3Model": "DeepSpec's EAGLE-3 has q/k norms, 5 taps and its own embedding layout",
    "DFlash2DraftModel": "DFlash-2 adds dynamic convolutions and a candidate selector",
    "DSparkDraftModel": "SpecForge's DSpark drafts unshifted blocks (B - 1 drafts, DFlash's"
                        " convention) with its heads configured in dflash_config; ours reads"
                        " DeepSpec's shifted Qwen3DSparkModel",
}


def detect_kind(hf: Mapping[str, Any], *, source: str = "config.json") -> str:
  """The layout ("eagle3", "dflash", "dspark" or "domino") a drafter's config.json describes.

  Raises:
    CheckpointFormatError: an unknown or unsupported layout.
  """
  archs = list(hf.get("architectures") or [])
  for arch in archs:
    if arch in _UNSUPPORTED:
      raise CheckpointFormatError(
          f"{source}: architecture {arch!r} is not supported ({_UNSUPPORTED[arch]}, which our"
          f" drafters cannot represent). Supported: {_SUPPORTED}.")
  if dspark.ARCHITECTURE in archs:
    return "dspark"
  options = dict(hf.get("dflash_config") or {})
  projector = options.get("projector_type")
  if domino.ARCHITECTURE in archs or projector == "domino":
    return "domino"
  if projector not in (None, "dflash") or options.get("shift_label"):
    raise CheckpointFormatError(
        f"{source}: a DFlash variant with projector_type={projector!r},"
        f" shift_label={options.get('shift_label')!r} is not supported (unshifted DFlash blocks"
        " map onto our block drafter, shifted ones with a 'domino' projector onto Domino).")
  if dflash.ARCHITECTURE in archs or options or (
      not archs and "block_size" in hf and "mask_token_id" in hf):
    return "dflash"
  eagle_hints = "draft_vocab_size" in hf or "eagle_config" in hf
  if any(a in eagle3.ARCHITECTURES[:2] for a in archs) or (
      eagle_hints and (not archs or "LlamaForCausalLM" in archs)):
    return "eagle3"
  raise CheckpointFormatError(
      f"{source} describes no drafter we can read (architectures={archs!r}"
      + (", it looks like a target model" if archs and not eagle_hints else "")
      + "). Supported: EAGLE-3 (architectures " + ", ".join(eagle3.ARCHITECTURES)
      + f" with draft_vocab_size or eagle_config), DFlash ({dflash.ARCHITECTURE!r}), DSpark"
      f" ({dspark.ARCHITECTURE!r}) and Domino ({domino.ARCHITECTURE!r}).")
