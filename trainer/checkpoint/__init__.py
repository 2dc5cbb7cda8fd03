"""Checkpoints: the manager the training loop calls (``manager``), its crash-safe saves
(``writer``), rank 0's decisions shared (``agreement``) and what DCP saves (``states``), the training-checkpoint folder it writes and the converters read (``folders``), its
checksums and finite check (``integrity``), which checkpoints are the run's current history
(``timeline``), a save the disk refuses (``save_failures``, ``disk``), Hugging Face model folders
(``hf_folders``) and starting weights read from one (``hf_load``); the converters' output, whole
or not at all (``disk``)."""
