"""Reinforcement learning: policy losses, advantages, vocab-parallel log-probs, the actor and the loop."""
