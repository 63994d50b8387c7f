"""HF <-> Megatron weights: the one name/shape mapping, conversion, dist-checkpoint save/load."""
