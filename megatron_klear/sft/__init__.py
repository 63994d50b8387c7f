"""Long chain-of-thought SFT: ``torchrun ... -m megatron_klear sft --config CONFIG.yaml [key=value ...]``."""
