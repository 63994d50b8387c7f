"""HF config -> Megatron-Core model (TransformerConfig + layer spec)."""
