"""Data: from JSONL conversations to packed micro-batches.

One example's path, module by module:

- ``jsonl``       reads input lines, keeps file + line number on every error, and applies the
                  skip-or-fail policy for bad lines.
- ``chat``        turns a line into messages, renders them with the tokenizer's own chat template
                  and marks which tokens are the assistant's (the only ones that carry loss).
- ``preprocess``  tokenizes whole files once, in parallel, into a Megatron-Core indexed dataset
                  plus a metadata JSON (``python tools/preprocess_sft.py``).
- ``indexed``     that on-disk format (tokens, loss spans, metadata) and its reader.
- ``packing``     the best-fit-decreasing packer and the packed micro-batch layout
                  (cu_seqlens, restarting positions, shifted labels); shared by SFT and RL.
- ``sft_dataset`` the training-side reader: deterministic, DP-sharded, resumable packed
                  micro-batches.
- ``curate``      the paper's SFT data policy (difficulty from pass rate; keep wrong answers only
                  for hard prompts; exact dedup) behind ``python tools/curate_sft.py``.

Nothing here imports megatron.core or torch at module import time except where the module's job
is to produce tensors or indexed datasets, and even there the import happens inside functions.
"""
