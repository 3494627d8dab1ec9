"""Training methods: the registry every method joins (registry) and the flags each declares; Dopamine,
DP-FedAvg with intermediaries, their per-example gradients and update rules; Gaussian DP-SGD and the
baselines."""
