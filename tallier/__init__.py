"""The tallier role: receives one share of every hospital's noisy votes, adds them up, and computes
the winning labels with the other talliers in MPC (MPyC), so that nobody sees a vote or a sum."""
