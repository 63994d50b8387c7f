"""megatron-klear: Klear-Reasoner SFT + GPPO on Megatron-Core."""
__version__ = "0.1.0"
