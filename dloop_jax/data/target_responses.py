"""The `target_responses` TFDS builder: the target's own answers and hidden states.

Drafters learn to imitate the target, so they train on responses the target
itself generates, and on the target's hidden states at the tapped layers. For
each prompt (ShareGPT first user messages, or random token ids for tiny
targets) the builder runs our batched `generate()` in mode "ar" with
`capture_taps`, which returns the tapped hidden states of every position the
target read while generating: no second forward pass. With `grow_cache` the
KV cache grows with the longest row, so a step attends over about the live
context, not the whole capacity. Capturing adds little to the decode, where a
second forward over the finished sequences, even packed, would add a large
part of it (measurements: docs/data.md).

Every example (L = prompt_len + response_len):

    index         int64               position in generation order (prompts
                                      sorted by length); batch = index // batch_size
    prompt_key    str                 ShareGPT conversation id, or "random/<i>"
    tokens        [L] int32           prompt, then the response
    loss_mask     [L] int32           1 at response positions, 0 on the prompt
    prompt_len    int32
    response_len  int32               stop token included when one was hit
    stopped       bool                the response ended with a stop token
    features      [L, n_taps, D] f16  taps of layer taps[j] after reading tokens[t];
                                      the last position is all zeros (the target
                                      never reads the last token; nothing in the
                                      example is predicted from it); values beyond
                                      +-65504 are clipped (counted in
                                      metadata["totals"]["features_clipped"])
    target_topk_ids   [L, k] int32    with `target_topk` = k > 0: the target's k
    target_topk_probs [L, k] f16      most likely next tokens after reading
                                      tokens[t] and their probabilities
                                      (softmax of the raw logits, temperature
                                      1, descending); last position zeros.
                                      Distillation targets (DSpark's L1 and
                                      confidence terms); computed in the
                                      forward over the finished answers

Reproducibility: batch b (prompts `index` in [b * B, (b + 1) * B)) is
generated with `seed=batch_key(seed, b)`; a last partial batch is filled up to
B with copies of its last prompt (their outputs are discarded), so every call
has the same shape. With temperature 0 the batching does not matter, up to
floating-point near-ties (on the default model batch 1 and batch 8 gave the
same tokens).

Resumable: prompts are generated in chunks of `chunk_size` and each finished
chunk is saved atomically (`chunk_00012.npz`, written to a temporary name,
then renamed) in a work directory outside the dataset. A killed build,
restarted with the same command, loads the finished chunks and generates only
the missing ones. Progress (prompts done / total, tokens/s, ETA) goes to
stderr.

Writing: once every chunk is finished, the examples stream into array_record
shards of at most 1 GB (`shard_writer`), in the order TFDS's shuffling writer
would store them (hash of `index`); the chunks' features are memory-mapped, so
memory holds one example, not the split.

Metadata (`info.metadata`, also `metadata.json` next to the data): target name
and fingerprint, taps, hidden size, the whole config, prompt filter counts and
generation throughput. `pipeline.check_dataset_matches` refuses a dataset made
for other taps or another target.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from dloop_jax.data import shard_writer
from dloop_jax.data import sharegpt as sharegpt_lib
from dloop_jax.data import taps_forward
from dloop_jax.data.build_progress import Progress
from dloop_jax.data.chunk_cache import chunk_example, load_chunk, load_chunk_if_exists
from dloop_jax.data.response_store import (ResponseStore, answer_spec, claim_directory,
                                           save_npz_atomic, store_name)
from dloop_jax.data.target_responses_config import (NAME, TRAIN, WORK_DIR_NAME,
                                                    TargetResponsesConfig, make_config,
                                                    snapshot_config, target_slug)
from dloop_jax.data.tfds_utils import FILE_FORMAT, LocalBuilder, no_network_download_config
from dloop_jax.data.training_prompts import (ByteTokenizer, Prompt, ShareGPTRecord, by_length,
                                             encode_prompt, prompts_digest,
                                             select_sharegpt_prompts)
from dloop_jax.errors import ConfigError


def default_work_dir(data_dir: str | os.PathLike, config: TargetResponsesConfig) -> str:
  """Where a build of `config` under `data_dir` keeps its finished chunks."""
  return os.path.join(os.fspath(data_dir), WORK_DIR_NAME, config.name,
                      str(TargetResponses.VERSION))


def batch_key(seed: int, batch_index: int):
  """The PRNG key batch `batch_index` is generated with."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.random.fold_in(jax.random.key(seed), batch_index)


# ----------------------------------------------------------------- builder
class TargetResponses(LocalBuilder):
  """Target-regenerated responses with the target's tapped hidden states."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {
      "1.0.0": "Initial release.",
      "1.1.0": "ShareGPT prompts deduplicated, and none equal to a held-out prompt.",
  }
  BUILDER_CONFIGS = [make_config(name="smollm2_default")]
  DEFAULT_CONFIG_NAME = "smollm2_default"

  def __init__(self, *, target_model: Any = None, tokenizer: Any = None,
               work_dir: str | None = None, progress: bool = True,
               on_chunk: Callable[..., None] | None = None,
               sharegpt_data_dir: str | None = None, finished_chunks_only: bool = False,
               max_shard_bytes: int = shard_writer.DEFAULT_MAX_SHARD_BYTES,
               max_shard_examples: int | None = None, responses_dir: str | None = None,
               **kwargs):
    """Args beyond TFDS's (`data_dir`, `config`, `file_format`, ...).

    Args:
      target_model: an already built target (`Transformer`); the config's
        `target` is then only its name. Default: built from the config.
      tokenizer: its tokenizer (None: the loaded target's, or bytes).
      work_dir: where finished chunks are kept between runs (default
        `<data_dir>/target_responses_work/<config name>/<version>`).
      progress: print progress lines to stderr.
      on_chunk: called as `on_chunk(i, num_chunks, reused=bool)` when the
        i-th chunk (in processing order) is ready: saved, or loaded from an
        earlier run.
      sharegpt_data_dir: where the sharegpt dataset is (default: data_dir).
      finished_chunks_only: a snapshot: write only the chunks already
        finished in `work_dir` (generate nothing). Use another config name
        (see `snapshot_config`) so the full build stays resumable.
      max_shard_bytes / max_shard_examples: when an array_record shard is
        closed (see `shard_writer.write_split`); they do not change the data.
      responses_dir: a root of response stores (`response_store`): a chunk
        whose answers are stored there gets its features from one forward
        pass over them instead of being answered again, and every chunk this
        build answers is stored there too.
    """
    self._responses_dir = responses_dir
    self._max_shard_bytes = max_shard_bytes
    self._max_shard_examples = max_shard_examples
    self._target_model = target_model
    self._tokenizer = tokenizer
    self._work_dir = work_dir
    self._progress = progress
    self._on_chunk = on_chunk
    self._sharegpt_data_dir = sharegpt_data_dir
    self._finished_chunks_only = finished_chunks_only
    self._resolved = None
    self.chunks_generated = 0
    self.chunks_reused = 0
    self.chunks_from_store = 0
    self._store: ResponseStore | None = None
    super().__init__(**kwargs)

  # ------------------------------------------------------------- target
  def target(self) -> tuple[Any, Any, str]:
    """(model, tokenizer or None, name), built once."""
    if self._resolved is None:
      c: TargetResponsesConfig = self.builder_config
      if self._target_model is not None:
        self._resolved = (self._target_model, self._tokenizer, c.target)
      elif c.target == "tiny":
        from dloop_jax.models.transformer import (  # pylint: disable=g-import-not-at-top
            tiny_target, tiny_target_name)
        model = tiny_target(seed=c.target_seed, init_std=c.target_init_std)
        self._resolved = (model, self._tokenizer,
                          tiny_target_name(seed=c.target_seed, init_std=c.target_init_std))
      else:
        from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
        loaded = load_target(c.target, dtype="float32")
        self._resolved = (loaded.model, self._tokenizer or loaded.tokenizer, loaded.name)
    return self._resolved

  def taps(self) -> tuple[int, ...]:
    from dloop_jax.models.config import default_taps  # pylint: disable=g-import-not-at-top
    c: TargetResponsesConfig = self.builder_config
    config = self.target()[0].config
    taps = tuple(c.taps) or default_taps(config.num_layers)
    bad = [t for t in taps if not 0 <= t < config.num_layers]
    if bad:
      raise ConfigError(f"taps {bad} are not decoder layers of the target"
                        f" (0..{config.num_layers - 1}).")
    return taps

  def topk(self) -> int:
    """k of the stored target distributions (0 = none), checked against the vocabulary."""
    k = self.builder_config.target_topk
    vocab = self.target()[0].config.vocab_size
    if k > vocab:
      raise ConfigError(f"target_topk={k} exceeds the target's vocabulary of {vocab} tokens.")
    return k

  def _info(self) -> tfds.core.DatasetInfo:
    model = self.target()[0]
    n_taps, d = len(self.taps()), model.config.hidden_size
    k = self.topk()
    topk = ({"target_topk_ids": tfds.features.Tensor(shape=(None, k), dtype=np.int32),
             "target_topk_probs": tfds.features.Tensor(shape=(None, k), dtype=np.float16,
                                                       encoding=tfds.features.Encoding.BYTES)}
            if k else {})
    return tfds.core.DatasetInfo(
        builder=self,
        description="Responses regenerated by the target, with its tapped hidden states.",
        features=tfds.features.FeaturesDict({
            "index": tfds.features.Scalar(np.int64),
            "prompt_key": tfds.features.Text(),
            "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "prompt_len": tfds.features.Scalar(np.int32),
            "response_len": tfds.features.Scalar(np.int32),
            "stopped": tfds.features.Scalar(np.bool_),
            # Raw bytes: the proto float list would widen float16 to float32.
            "features": tfds.features.Tensor(shape=(None, n_taps, d), dtype=np.float16,
                                             encoding=tfds.features.Encoding.BYTES),
            **topk,
        }),
        metadata=tfds.core.MetadataDict(),
    )

  # ------------------------------------------------------------- prompts
  def _tokenizer_for_prompts(self):
    model, tokenizer, _ = self.target()
    return tokenizer if tokenizer is not None else ByteTokenizer(model.config.vocab_size)

  def _prompt_limit(self) -> int:
    """Prompt tokens at most: max_prompt_tokens, within the target's context."""
    c: TargetResponsesConfig = self.builder_config
    context = self.target()[0].config.max_position_embeddings
    return min(c.max_prompt_tokens, context - c.max_new_tokens)

  def _prompts(self) -> tuple[list[Prompt], dict[str, int]]:
    c: TargetResponsesConfig = self.builder_config
    model = self.target()[0]
    vocab = model.config.vocab_size
    limit = self._prompt_limit()
    if limit < 1:
      raise ConfigError(f"max_new_tokens={c.max_new_tokens} leaves no room for a prompt in the"
                        f" target's context of {model.config.max_position_embeddings} tokens.")
    if c.prompt_source == "random":
      rng = np.random.default_rng(c.seed)
      out = []
      for i in range(c.num_prompts):
        n = int(rng.integers(c.random_prompt_min_len, c.random_prompt_max_len + 1))
        n = min(n, limit)
        out.append(Prompt(key=f"random/{i}", ids=tuple(int(t) for t in rng.integers(0, vocab, n))))
      return out, {"examined": len(out), "overlong_tokens": 0, "continuation": 0}
    sg = sharegpt_lib.build_sharegpt(
        data_dir=self._sharegpt_data_dir or os.fspath(self.data_dir_root),
        **c.sharegpt_options())
    sources = sg.as_data_source()
    records = sorted(((int(r["index"]), _text(r["id"]), _text(r["first_user_message"]),
                       bool(r["starts_with_user"])) for r in sources[sharegpt_lib.TRAIN]),
                     key=lambda r: r[0])
    heldout = (_text(r["first_user_message"]) for r in sources[sharegpt_lib.HELDOUT]
               ) if sharegpt_lib.HELDOUT in sources else ()
    tokenizer = self._tokenizer_for_prompts()
    out, counts = select_sharegpt_prompts(
        [ShareGPTRecord(key=conv_id, text=text, starts_with_user=first)
         for _, conv_id, text, first in records],
        heldout_texts=heldout, num_prompts=c.num_prompts, seed=c.seed,
        skip_continuations=c.skip_continuations, max_tokens=limit,
        encode=lambda text: encode_prompt(text, tokenizer=tokenizer,
                                          chat_template=c.chat_template,
                                          system_prompt=c.system_prompt))
    counts["sharegpt_dropped"] = dict(sg.info.metadata.get("dropped", {}))
    return out, counts

  def _sorted_prompts(self) -> tuple[list[Prompt], dict[str, int]]:
    """The prompts in generation order (by length), and the filter counts."""
    prompts, counts = self._prompts()
    if not prompts:
      raise ConfigError("No prompt survived the filters (see max_prompt_tokens,"
                        " skip_continuations); nothing to generate.")
    return by_length(prompts), counts

  # ------------------------------------------------------------- splits
  @property
  def work_dir(self) -> str:
    return self._work_dir or default_work_dir(self.data_dir_root, self.builder_config)

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    c: TargetResponsesConfig = self.builder_config
    prompts, counts = self._sorted_prompts()
    model, _, target_name = self.target()
    plan = {"config": c.spec(), "target_name": target_name, "taps": list(self.taps()),
            "prompts": prompts_digest(prompts)}
    self._store = self._open_store(prompts)
    claim_directory(self.work_dir, plan, refusal=(
        f"The work directory {self.work_dir} holds chunks of a different build (other"
        " prompts, target or settings). Delete it, or pass another work_dir."))
    self.info.metadata.update({
        "target_name": target_name,
        "target_fingerprint": dict(model.config.fingerprint),
        "taps": list(self.taps()),
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "config": c.spec(),
        "prompt_counts": counts,
        "features_layout": "features[t] = taps after reading tokens[t]; last position zeros",
    })
    return {TRAIN: self._generate_examples(prompts)}

  def _generate_splits(self, dl_manager, download_config):
    """Streams each split into array_record shards (see `shard_writer`), no TFDS shuffler."""
    del download_config  # no Beam, no example limit: every prompt is answered
    limits = {"max_shard_bytes": self._max_shard_bytes,
              "max_shard_examples": self._max_shard_examples}
    return shard_writer.split_infos_for(self, self._split_generators(dl_manager), **limits)

  def _generate_examples(self, prompts: list[Prompt]):
    """Finishes every chunk, then yields the examples in TFDS's (hashed key) order."""
    chunks = self._finish_chunks(prompts)
    located = {}  # index -> (chunk, row)
    for chunk in chunks:
      for row, index in enumerate(chunk["index"].tolist()):
        located[index] = (chunk, row)
    offsets = {id(c): np.concatenate([[0], np.cumsum(c["lengths"])]) for c in chunks}
    for index in shard_writer.tfds_order(located, split=TRAIN):
      chunk, row = located[index]
      yield chunk_example(chunk, offsets[id(chunk)], row)

  def _finish_chunks(self, prompts: list[Prompt]) -> list[dict[str, np.ndarray]]:
    """Loads the finished chunks and generates the missing ones; sets metadata totals."""
    c: TargetResponsesConfig = self.builder_config
    n = len(prompts)
    num_chunks = -(-n // c.chunk_size)
    progress = Progress(total=n, done=0, enabled=self._progress)
    totals = {"examples": 0, "tokens": 0, "response_tokens": 0, "generation_seconds": 0.0,
              "new_tokens": 0, "compile_seconds": 0.0,
              "features_clipped": 0, "features_seconds": 0.0}
    missing, chunks = [], []
    # Chunks hold prompts of similar length (sorted); visiting them in a
    # seeded random order keeps the tokens/s and ETA estimates unbiased.
    order = np.random.default_rng(c.seed).permutation(num_chunks).tolist()
    answered = set()  # chunks answered by this run's first pass
    if not self._finished_chunks_only and self._store is not None:
      # The prompts the store has not answered come first: their taps are
      # captured while decoding, at no extra cost, and the store keeps growing
      # before the forwards over its stored answers (the second pass) start.
      # The first pass reports its own progress: prompts to answer, and their ETA.
      unanswered = [k for k in order if not self._answered(k, n=n)]
      first = Progress(total=sum(len(self._chunk_index(k, n=n)) for k in unanswered), done=0,
                       enabled=self._progress)
      for k in unanswered:
        totals["features_seconds"] += self._answer_chunk(prompts, k, n=n, progress=first)
        answered.add(k)
    for position, k in enumerate(order):
      lo, hi = k * c.chunk_size, min(n, (k + 1) * c.chunk_size)
      path = self._chunk_path(k)
      index = self._chunk_index(k, n=n)
      arrays = load_chunk_if_exists(path, expected_index=index)
      reused = arrays is not None and k not in answered
      # A snapshot computes nothing: chunks whose features are not written
      # yet are missing from it, stored answers or not.
      answers = (self._store.load(k, expected_index=index)
                 if arrays is None and self._store is not None
                 and not self._finished_chunks_only else None)
      if arrays is None and answers is None and self._finished_chunks_only:
        missing.append(k)
        continue
      if arrays is not None:  # finished before this pass: not in its rate or ETA
        self.chunks_reused += reused
        progress.done += hi - lo
        progress.start_done += hi - lo
      else:
        if answers is not None:
          chunk = self._features_chunk(answers)
          totals["features_seconds"] += float(chunk["features_seconds"])
          self.chunks_from_store += 1
          progress.update(prompts=hi - lo, new_tokens=0,
                          read_tokens=int(answers["lengths"].sum()))
          save_npz_atomic(path, chunk)
        else:
          totals["features_seconds"] += self._answer_chunk(prompts, k, n=n, progress=progress)
        arrays = load_chunk(path, expected_index=index)  # features memory-mapped
      totals["generation_seconds"] += float(arrays["seconds"])
      totals["compile_seconds"] += float(arrays["compile_seconds"])
      totals["new_tokens"] += int(arrays["new_tokens"])
      totals["features_clipped"] += int(arrays["clipped"])
      totals["examples"] += len(arrays["index"])
      totals["tokens"] += int(arrays["lengths"].sum())
      totals["response_tokens"] += int((arrays["lengths"] - arrays["prompt_lens"]).sum())
      chunks.append(arrays)
      if self._on_chunk is not None:
        self._on_chunk(position, num_chunks, reused=reused)
    gen_s = totals["generation_seconds"]
    wall_s = gen_s + totals["compile_seconds"]
    totals["new_tokens_per_second"] = totals["new_tokens"] / gen_s if gen_s else 0.0
    totals["new_tokens_per_second_with_compile"] = totals["new_tokens"] / wall_s if wall_s else 0.0
    self.info.metadata["totals"] = totals
    if self._finished_chunks_only:
      self.info.metadata["snapshot"] = {
          "chunks_used": num_chunks - len(missing), "chunks_total": num_chunks,
          "prompts_used": totals["examples"], "prompts_total": n,
          "missing_chunks": sorted(missing)}
      if not totals["examples"]:
        raise ConfigError(f"No finished chunk in {self.work_dir}: nothing to snapshot yet.")
    if self._progress:
      print(f"[{NAME}] {totals['examples']} of {n} prompts ready ({self.chunks_reused} chunks"
            f" reused, {self.chunks_from_store} from stored answers, {self.chunks_generated}"
            " generated); writing the dataset.", file=sys.stderr,
            flush=True)
    return chunks

  def _chunk_path(self, k: int) -> str:
    return os.path.join(self.work_dir, f"chunk_{k:05d}.npz")

  def _chunk_index(self, k: int, *, n: int) -> np.ndarray:
    """The prompt indices of chunk k (of n prompts)."""
    size = self.builder_config.chunk_size
    return np.arange(k * size, min(n, (k + 1) * size), dtype=np.int64)

  def _answered(self, k: int, *, n: int) -> bool:
    """Whether chunk k's answers are in the store or its finished arrays in the work directory."""
    index = self._chunk_index(k, n=n)
    return ((self._store is not None and self._store.load(k, expected_index=index) is not None)
            or load_chunk_if_exists(self._chunk_path(k), expected_index=index) is not None)

  def _answer_chunk(self, prompts: list[Prompt], k: int, *, n: int, progress: Progress) -> float:
    """Answers chunk k, stores the answers and writes the finished chunk.

    Returns the seconds spent computing features apart from the decoding.
    """
    c: TargetResponsesConfig = self.builder_config
    lo, hi = k * c.chunk_size, min(n, (k + 1) * c.chunk_size)
    # Target distributions need the logits of every position: answer first,
    # then one forward over the answers.
    chunk = self._generate_chunk(prompts, lo=lo, hi=hi, progress=progress,
                                 capture=not self.topk())
    if self._store is not None:
      self._store.save(k, chunk)
    features_seconds = 0.0
    if self.topk():
      chunk = self._features_chunk(chunk)
      features_seconds = float(chunk["features_seconds"])
    self.chunks_generated += 1
    save_npz_atomic(self._chunk_path(k), chunk)
    return features_seconds

  def _generate_chunk(self, prompts: list[Prompt], *, lo: int, hi: int,
                      progress: Progress, capture: bool = True) -> dict[str, np.ndarray]:
    """Answers prompts [lo, hi) in batches; returns the chunk's flat arrays.

    With `capture=False` only the answers (`response_store.ANSWER_KEYS`).
    """
    from dloop_jax.decoding import SamplingConfig, generate  # pylint: disable=g-import-not-at-top
    c: TargetResponsesConfig = self.builder_config
    model, _, _ = self.target()
    tokenizer = self._tokenizer_for_prompts()
    stops = tuple(getattr(tokenizer, "stop_token_ids", ()) or ()) or tuple(
        model.config.eos_token_ids)
    sampling = SamplingConfig(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
    taps = self.taps()
    tokens, features, lengths, prompt_lens, stopped = [], [], [], [], []
    seconds = compile_seconds = 0.0
    new_tokens = clipped = 0
    for start in range(lo, hi, c.batch_size):
      batch = prompts[start:min(hi, start + c.batch_size)]
      real = len(batch)
      # Fill a short last batch with copies: same shapes, no extra compile.
      ids = [list(p.ids) for p in batch] + [list(batch[-1].ids)] * (c.batch_size - real)
      out = generate(model, ids, max_new_tokens=c.max_new_tokens, sampling=sampling,
                     seed=batch_key(c.seed, start // c.batch_size), stop_tokens=stops,
                     capture_taps=taps if capture else (), grow_cache=True)
      seconds += out.seconds  # compiled execution only; compilation is counted apart
      compile_seconds += out.compile_seconds
      batch_new = 0
      for i in range(real):
        response = out.tokens[i]
        seq = np.asarray(list(batch[i].ids) + list(response), np.int32)
        if capture:
          feats, n_clipped = taps_forward.stored_features(np.asarray(out.features[i], np.float32),
                                              length=len(seq))
          features.append(feats)
          clipped += n_clipped
        tokens.append(seq)
        lengths.append(len(seq))
        prompt_lens.append(len(batch[i].ids))
        stopped.append(bool(response) and int(response[-1]) in stops)
        batch_new += len(response)
      new_tokens += batch_new
      progress.update(prompts=real, new_tokens=batch_new)
    arrays = {
        "index": np.arange(lo, hi, dtype=np.int64),
        "keys": np.asarray([p.key for p in prompts[lo:hi]], dtype=str),
        "tokens": np.concatenate(tokens),
        "lengths": np.asarray(lengths, np.int64),
        "prompt_lens": np.asarray(prompt_lens, np.int64),
        "stopped": np.asarray(stopped, bool),
        "seconds": np.asarray(seconds),
        "compile_seconds": np.asarray(compile_seconds),
        "new_tokens": np.asarray(new_tokens),
    }
    if capture:
      arrays.update(features=np.concatenate(features), clipped=np.asarray(clipped))
    return arrays

  def _features_chunk(self, answers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A chunk of stored answers with its features (`taps_forward.features_chunk`)."""
    return taps_forward.features_chunk(answers, model=self.target()[0], taps=self.taps(),
                                       topk=self.topk())

  # ------------------------------------------------------- answers only
  def _open_store(self, prompts: list[Prompt]) -> ResponseStore | None:
    if not self._responses_dir:
      return None
    c: TargetResponsesConfig = self.builder_config
    _, _, target_name = self.target()
    plan = {"config": answer_spec(c.spec()), "target_name": target_name,
            "prompts": prompts_digest(prompts)}
    name = store_name(target_slug=target_slug(target_name), spec=c.spec())
    return ResponseStore(self._responses_dir, name=name, plan=plan)

  def answer_prompts(self) -> dict[str, Any]:
    """Answers every prompt into the response store, computing no features.

    The resumable first half of a build, for machines where the features
    would not fit or not survive: rerun to resume; a later build with the same
    `responses_dir` computes the features from the stored answers.

    Returns:
      {"store_dir", "chunks_total", "chunks_generated", "chunks_reused",
       "prompts", "new_tokens", "generation_seconds", "new_tokens_per_second"}.
    """
    if not self._responses_dir:
      raise ConfigError("Answering prompts alone needs a responses_dir to keep the answers in.")
    c: TargetResponsesConfig = self.builder_config
    prompts, _ = self._sorted_prompts()
    store = self._open_store(prompts)
    n = len(prompts)
    num_chunks = -(-n // c.chunk_size)
    progress = Progress(total=n, done=0, enabled=self._progress)
    summary = {"store_dir": store.dir, "chunks_total": num_chunks, "chunks_generated": 0,
               "chunks_reused": 0, "prompts": n, "new_tokens": 0, "generation_seconds": 0.0}
    for k in np.random.default_rng(c.seed).permutation(num_chunks).tolist():
      lo, hi = k * c.chunk_size, min(n, (k + 1) * c.chunk_size)
      answers = store.load(k, expected_index=np.arange(lo, hi, dtype=np.int64))
      if answers is None:
        answers = self._generate_chunk(prompts, lo=lo, hi=hi, progress=progress, capture=False)
        store.save(k, answers)
        summary["chunks_generated"] += 1
      else:
        summary["chunks_reused"] += 1
        progress.done += hi - lo
        progress.start_done += hi - lo
      summary["new_tokens"] += int(answers["new_tokens"])
      summary["generation_seconds"] += float(answers["seconds"])
    seconds = summary["generation_seconds"]
    summary["new_tokens_per_second"] = summary["new_tokens"] / seconds if seconds else 0.0
    return summary


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------ programmatic
@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildResult:
  """What `build_target_responses` made.

  Attributes:
    dataset_dir: the TFDS version directory (`.../target_responses/<config>/1.0.0`),
      what `pipeline.make_train_iterator(path=...)` and the trainer's
      `data.path` take (the data_dir above it works too when it holds one
      dataset).
    config: the builder config.
    chunks_generated / chunks_reused: work done in this call / loaded from an
      earlier, interrupted one (both 0 when the dataset already existed).
    metadata: the dataset's metadata.
  """

  dataset_dir: str
  config: TargetResponsesConfig
  chunks_generated: int
  chunks_reused: int
  metadata: dict[str, Any]


def build_target_responses(
    *,
    out_dir: str,
    target: Any = "tiny",
    target_name: str | None = None,
    tokenizer: Any = None,
    taps: Sequence[int] = (),
    num_examples: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
    name: str | None = None,
    work_dir: str | None = None,
    keep_work_dir: bool = False,
    progress: bool = True,
    on_chunk: Callable[..., None] | None = None,
    sharegpt_data_dir: str | None = None,
    snapshot: bool = False,
    max_shard_bytes: int = shard_writer.DEFAULT_MAX_SHARD_BYTES,
    max_shard_examples: int | None = None,
    **options,
) -> BuildResult:
  """Builds (or reuses) a `target_responses` dataset under `out_dir`.

  Args:
    out_dir: the TFDS data_dir.
    target: a `Transformer`, or a config spec ("tiny", a registry name, a
      .gguf / HF dir).
    target_name: the name recorded for a given `Transformer` (the trainer
      passes its own, e.g. "tiny(seed=1,init_std=0.3)").
    tokenizer: tokenizer of a given `Transformer` (None: bytes for ShareGPT).
    taps: tapped layers (() = the target's default taps).
    num_examples: prompts to answer (`num_prompts`).
    seq_len: with random prompts and no explicit `max_new_tokens` /
      `random_prompt_max_len`, choose them so that examples fit `seq_len`
      (prompts up to seq_len // 4 tokens, responses the rest).
    seed: prompt selection and sampling seed.
    name: builder config name (default: derived from every setting).
    work_dir: chunk directory (see `TargetResponses`).
    keep_work_dir: keep the chunks after a successful build (by default they
      are deleted: they duplicate the dataset).
    progress: print progress to stderr.
    on_chunk: see `TargetResponses`.
    sharegpt_data_dir: where the sharegpt dataset is built (default out_dir).
    snapshot: write a dataset of the chunks this build has finished so far
      (generate nothing), under the config name + "_snapshot"; the chunks are
      kept, so the full build stays resumable.
    max_shard_bytes / max_shard_examples: array_record shard limits.
    **options: other `TargetResponsesConfig` fields (prompt_source,
      max_new_tokens, temperature, batch_size, chunk_size, ...).

  Returns:
    A `BuildResult`.
  """
  model = None
  if not isinstance(target, str):
    model = target
    spec = target_name or getattr(model.config, "name", "") or "custom"
  else:
    spec = target
  fields = dict(options)
  fields.setdefault("prompt_source", "random")
  if num_examples is not None:
    fields["num_prompts"] = int(num_examples)
  if seq_len is not None and fields["prompt_source"] == "random":
    fields.setdefault("random_prompt_max_len", max(1, seq_len // 4))
    fields.setdefault("random_prompt_min_len", min(4, fields["random_prompt_max_len"]))
    fields.setdefault("max_new_tokens", max(1, seq_len - fields["random_prompt_max_len"]))
  if "batch_size" in fields and "chunk_size" not in fields:
    fields["chunk_size"] = int(fields["batch_size"]) * max(1, 64 // int(fields["batch_size"]))
  config = make_config(name=name, target=spec, taps=tuple(taps), seed=int(seed), **fields)
  if snapshot:
    work_dir = work_dir or default_work_dir(out_dir, config)
    config, keep_work_dir = snapshot_config(config), True
  builder = TargetResponses(
      data_dir=out_dir, config=config, file_format=FILE_FORMAT, target_model=model,
      tokenizer=tokenizer, work_dir=work_dir, progress=progress, on_chunk=on_chunk,
      sharegpt_data_dir=sharegpt_data_dir, finished_chunks_only=snapshot,
      max_shard_bytes=max_shard_bytes, max_shard_examples=max_shard_examples)
  builder.download_and_prepare(download_config=no_network_download_config())
  if not keep_work_dir and os.path.isdir(builder.work_dir):
    shutil.rmtree(builder.work_dir, ignore_errors=True)
  metadata = dict(builder.info.metadata) if builder.info.metadata is not None else {}
  return BuildResult(dataset_dir=os.fspath(builder.data_dir), config=config,
                     chunks_generated=builder.chunks_generated,
                     chunks_reused=builder.chunks_reused, metadata=metadata)
