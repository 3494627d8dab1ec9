"""Cryptography for secure aggregation: BFV parameters, fixed-point encoding, BFV sums,
signed sealed boxes and identity keys. No networking, no machine learning."""
