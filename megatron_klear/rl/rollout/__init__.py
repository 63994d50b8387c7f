"""The rollout side of the RL loop: the manager behind the loop's verbs (manager.py), what produces a
step's samples (full batches with dynamic sampling, sampling.py; partial rollouts, partial.py), when
they are generated (schedules.py), where the servers live (placement.py) and the weight check
(verify.py)."""
