"""Data: the built-in datasets and .npz files, an image folder of one's own, splits, and partitions
among hospitals."""
