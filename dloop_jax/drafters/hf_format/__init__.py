"""Public drafter checkpoints in Hugging Face layouts: EAGLE-3, DFlash, DSpark, Domino.

A directory with `config.json` and `model.safetensors` (or `pytorch_model.bin`)
as SafeAILab/EAGLE, SpecForge, z-lab/dflash, DeepSpec and Domino write them,
read into our drafters and written from them (so SGLang / vLLM can serve ours):

    EAGLE-3   `Eagle3Drafter`       eagle3.py
    DFlash    `BlockDrafter`        dflash.py   (drafts block_size - 1 per stage)
    DSpark    `DSparkDrafter`       dspark.py   (shifted: block_size per stage)
    Domino    `DominoDrafter`       domino.py   (shifted: block_size per stage)

`detect.py` tells the layouts apart from config.json, `load.py` reads one,
`write.py` writes ours, `common.py` holds what they share (PyTorch [out, in]
matrices vs our [in, out], fused q/k/v and gate/up, the fit checks).

A checkpoint's drafter rotates with the RoPE of its own config.json (theta
10000 when absent, as upstream: EAGLE-3 drafters of Llama-3.1 carry neither
theta nor scaling), not the target's; it must agree with the target on widths,
vocabulary and RMSNorm epsilon. What our drafters cannot represent is refused
with `CheckpointFormatError` saying why: EAGLE-3 variants with q/k norms,
biases or per-tap norms (DeepSpec's, `attention_bias`, `fc_norm`), DFlash-2,
taps of the input embeddings (DSpark's -1), Markov heads other than "vanilla",
Domino without shifted labels or with another pure-draft prefix, and
(writing) a learned mask vector in the block family (a draft vocabulary is left out with a
warning: no layout holds one, and no block-family weight depends on it).
"""

from dloop_jax.drafters.hf_format.common import CONFIG_FILE
from dloop_jax.drafters.hf_format.common import META_KEY
from dloop_jax.drafters.hf_format.common import SAFETENSORS_FILE
from dloop_jax.drafters.hf_format.common import TORCH_FILE
from dloop_jax.drafters.hf_format.detect import detect_kind
from dloop_jax.drafters.hf_format.detect import KINDS
from dloop_jax.drafters.hf_format.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from dloop_jax.drafters.hf_format.domino import ARCHITECTURE as DOMINO_ARCHITECTURE
from dloop_jax.drafters.hf_format.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from dloop_jax.drafters.hf_format.eagle3 import ARCHITECTURES as EAGLE3_ARCHITECTURES
from dloop_jax.drafters.hf_format.load import load_hf_drafter
from dloop_jax.drafters.hf_format.write import export_hf

__all__ = [
    "CONFIG_FILE", "META_KEY", "SAFETENSORS_FILE", "TORCH_FILE", "KINDS", "detect_kind",
    "load_hf_drafter", "export_hf", "DFLASH_ARCHITECTURE", "DOMINO_ARCHITECTURE",
    "DSPARK_ARCHITECTURE", "EAGLE3_ARCHITECTURES",
]
