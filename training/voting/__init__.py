"""Voting's learning: teachers' and kNN votes, the student trained on the released labels, and the
votes' privacy."""
