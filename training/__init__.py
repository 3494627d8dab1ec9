"""Learning: datasets and partitions, models, the Dopamine DP-SGD step and privacy accounting.
No networking, no cryptography."""
