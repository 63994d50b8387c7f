"""Model weights and their formats: the one HF <-> Megatron name/shape mapping, the weight formats
(``formats/``: HF safetensors, Megatron-Core torch_dist, their registry), conversion between them,
what ``model.path`` is, torch_dist save/load and the parity check.

``checkpoint/`` holds weight formats only. A training run's state (optimizer, RNG, scheduler, data
position) and the rules of its save directory are ``megatron_klear/training/checkpointing.py`` and
``megatron_klear/training/run_dir.py``."""
